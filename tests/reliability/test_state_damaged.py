"""A record in the server's SQLite state is damaged behind its back (a sandbox's and a job's
JSON overwritten, as bit rot or a hand edit would): calls on those records get a typed 500
naming them; listings, the reconciler and every other sandbox go on; DELETE still deletes the
damaged sandbox's record (its sandbox was reaped as an orphan); the damage is logged once, not every reconciler round."""

from __future__ import annotations

import sqlite3
import time

from tests.server.conftest import ServerProcess


def damage(server: ServerProcess, sandbox_id: str, job_id: str) -> None:
    db = sqlite3.connect(str(server.root / "server.db"), timeout=10)
    try:
        db.execute("UPDATE sandboxes SET sandbox = '{\"sandbox_id\": ' WHERE sandbox_id = ?", (sandbox_id,))
        db.execute("UPDATE jobs SET job = 'not json at all' WHERE job_id = ?", (job_id,))
        db.commit()
    finally:
        db.close()


def test_a_damaged_record_fails_its_own_calls_only(server_factory):
    server = server_factory(reconciler={"interval": 0.2, "lost_grace": 0})
    with server.http() as http:
        kept, damaged = (http.post("/sandboxes", json={}).json()["sandbox_id"] for _ in range(2))
        for sid, job_id in ((kept, "job-kept"), (damaged, "job-damaged")):
            answer = http.post(f"/sandboxes/{sid}/exec", json={"command": "echo hi", "wait": True, "job_id": job_id})
            assert answer.json()["stdout"] == "hi\n", answer.text
        damage(server, damaged, "job-damaged")

        for path, name in ((f"/sandboxes/{damaged}", damaged), ("/jobs/job-damaged", "job-damaged")):
            answer = http.get(path)
            assert answer.status_code == 500, answer.text
            error = answer.json()["error"]
            assert error["type"] == "StoreRecordDamaged" and name in error["message"], error
        listed = [s["sandbox_id"] for s in http.get("/sandboxes").json()["sandboxes"]]
        assert listed == [kept]
        time.sleep(1.5)  # reconciler rounds over the damaged record
        assert http.get(f"/sandboxes/{kept}").json()["status"] == "ready"  # not marked lost meanwhile
        again = http.post(f"/sandboxes/{kept}/exec", json={"command": "echo still", "wait": True})
        assert again.json()["stdout"] == "still\n"
        assert http.get("/jobs/job-kept").json()["stdout"] == "hi\n"
        running = [s.sandbox_id for s in _backend_sandboxes(server)]
        assert kept in running and damaged not in running  # reaped as an orphan: no readable record
        assert http.delete(f"/sandboxes/{damaged}").status_code in (200, 204)
        assert http.get(f"/sandboxes/{damaged}").status_code == 404  # and its record is gone
    assert server.process.poll() is None
    log = server.log_path.read_text()
    assert log.count(f"record of sandbox {damaged!r} is damaged") == 1, log[-3000:]  # once, not per round


def _backend_sandboxes(server: ServerProcess) -> list:
    """What the backend itself still runs (the local agent behind the server)."""
    from orchard.client import Client

    with Client(backend="local", backend_settings={"agent": {"state_dir": str(server.agent_state)}}) as client:
        return client.list()


def test_a_state_file_that_is_not_a_database_stops_the_server_with_a_clear_error_and_is_left_alone(tmp_path):
    import os
    import subprocess
    import sys

    state = tmp_path / "server.db"
    garbage = os.urandom(8192)
    state.write_bytes(garbage)
    done = subprocess.run([sys.executable, "-m", "orchard.cli", "serve", "--port", "0", "--api-key", "k",
                           "--state", str(state)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    said = " ".join((done.stderr + done.stdout).split())  # the console wraps long lines
    assert "StoreUnavailable" in said and "not a database" in said, said
    assert state.read_bytes() == garbage
