"""A record in the server's SQLite state is damaged behind its back (a sandbox's and a job's
JSON overwritten, as bit rot or a hand edit would): calls on those records get a typed 500
naming them; listings, the reconciler and every other sandbox go on; DELETE still deletes the
damaged sandbox's record (its sandbox was reaped as an orphan); the damage is logged once, not every reconciler round.
Below the rows, a page of the file overwritten under the running server gives the calls that
read it a typed 503, wherever in a query SQLite meets it."""

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


def _corrupt_page(path, table: str, last_leaf: bool = False) -> None:
    """Overwrite a b-tree page of ``table`` in the file with garbage, as a bad sector would: its
    root, or (``last_leaf``) the last leaf below an interior root, which a query reaches only
    after its first rows. Then commit elsewhere through another connection, so every reader
    drops its cached pages. The running server may write that page between the checkpoint and
    the overwrite (its newer copy in the WAL then hides the garbage): tried again until a
    fresh reader of ``table`` meets the damage."""
    for _ in range(20):
        _overwrite_page(path, table, last_leaf)
        db = sqlite3.connect(str(path), timeout=10)
        try:
            db.execute(f"SELECT * FROM {table}").fetchall()
        except sqlite3.DatabaseError:
            return
        finally:
            db.close()
    raise AssertionError(f"the damage to {table} never showed: the server rewrote the page every time")


def _overwrite_page(path, table: str, last_leaf: bool) -> None:
    db = sqlite3.connect(str(path), timeout=10)
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()  # every page in the file, none in the WAL
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
        page = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    finally:
        db.close()
    with open(path, "r+b") as file:
        if last_leaf:
            file.seek((page - 1) * page_size)
            header = file.read(12)
            assert header[0] == 0x05, f"{table}'s root is not an interior page: add rows"
            page = int.from_bytes(header[8:12], "big")  # the right-most child
        file.seek((page - 1) * page_size)
        file.write(b"\xa5" * page_size)
    db = sqlite3.connect(str(path), timeout=10)
    try:
        db.execute("INSERT OR REPLACE INTO meta VALUES ('damage-test', '1')")
        db.commit()
    finally:
        db.close()


def test_a_damaged_page_of_the_state_file_gives_typed_errors_and_the_server_stays_up(server_factory):
    server = server_factory(reconciler={"interval": 0.2, "lost_grace": 0})
    with server.http() as http:
        sandbox = http.post("/sandboxes", json={}).json()["sandbox_id"]
        for k in range(40):  # a jobs table of several pages: its root is an interior page
            answer = http.post(f"/sandboxes/{sandbox}/exec",
                               json={"command": "head -c 1500 /dev/zero | tr '\\0' x", "wait": True, "job_id": f"j{k}"})
            assert answer.status_code == 200, answer.text
        _corrupt_page(server.root / "server.db", "jobs")

        calls = [("GET", "/jobs/j3", None), ("GET", f"/sandboxes/{sandbox}", None), ("GET", "/sandboxes", None),
                 ("POST", f"/sandboxes/{sandbox}/exec", {"command": "echo after", "wait": True}),
                 ("POST", f"/sandboxes/{sandbox}/heartbeat", None)]
        for method, path, body in calls:
            answer = http.request(method, path, json=body)
            assert answer.status_code < 500 or answer.json()["error"]["type"] == "StoreUnavailable", (path, answer.text)
        assert http.get("/jobs/j3").status_code == 503  # the damaged table: a typed error, never a 500
        time.sleep(1.0)  # reconciler rounds over the damaged file
        assert http.get("/health").status_code == 200
    assert server.process.poll() is None


def test_a_damaged_page_met_after_the_first_rows_of_a_listing_is_a_typed_error_too(server_factory):
    server = server_factory(reconciler={"interval": 0.2, "lost_grace": 0})
    with server.http() as http:
        for k in range(12):  # a sandboxes table of several pages
            assert http.post("/sandboxes", json={"labels": {"filler": "x" * 900}}).status_code == 200
        _corrupt_page(server.root / "server.db", "sandboxes", last_leaf=True)
        answer = http.get("/sandboxes")
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "StoreUnavailable", answer.text
        time.sleep(1.0)  # reconciler rounds over it
        assert http.get("/health").status_code == 200
    assert server.process.poll() is None
