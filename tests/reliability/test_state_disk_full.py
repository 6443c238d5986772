"""The server's state disk fills up: SQLite write errors become a typed, retryable 503
(not a 500 and a dropped connection), the server keeps serving, and once space is freed
what was acknowledged is all there, the file passes SQLite's integrity check, and a retry
of a refused exec (same job id) returns the result of the one run, never a second run.

The store's WAL is copied into the database file in the background and then reused from its
start, so on a full disk small writes still fit in the space the WAL already holds (and
succeed, durably); the writes here are larger than anything the WAL held before the disk
filled, so they need new space and fail."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs for the state (needs root)")


@pytest.fixture
def small_state_disk():
    path = Path(f"/tmp/orchard-statefs-{os.getpid()}")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(path)], check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)
    path.rmdir()


def fill(path: Path) -> Path:
    filler = path / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=16k"], stderr=subprocess.DEVNULL, check=False)
    return filler


def test_a_full_state_disk_gives_typed_errors_and_loses_nothing(server_factory, small_state_disk):
    server = server_factory(state=str(small_state_disk / "server.db"), reconciler={"interval": 0.2, "lost_grace": 0})
    with server.http() as http:
        created = http.post("/sandboxes", json={})
        assert created.status_code == 200, created.text
        sid = created.json()["sandbox_id"]
        before = http.post(f"/sandboxes/{sid}/exec", json={"command": "echo kept", "wait": True, "job_id": "job-kept"})
        assert before.json()["stdout"] == "kept\n"
        filler = fill(small_state_disk)
        counter = "echo run >> /tmp/runs; wc -l < /tmp/runs; head -c 300000 /dev/zero | tr '\\0' x"
        refused = []
        for attempt in range(3):  # the same job id each time, as the SDK retries
            answer = http.post(f"/sandboxes/{sid}/exec", json={"command": counter, "wait": True, "job_id": "job-retried"})
            assert answer.status_code == 503, answer.text
            body = answer.json()["error"]
            assert body["type"] == "StoreUnavailable" and body["retryable"] and "full" in body["message"]
            refused.append(answer)
        create = http.post("/sandboxes", json={"labels": {"pad": "x" * 300_000}})
        assert create.status_code == 503 and create.json()["error"]["type"] == "StoreUnavailable", create.text
        assert http.get("/health").status_code == 200
        assert http.get(f"/sandboxes/{sid}").json()["status"] == "ready"  # reads still work
        assert http.get("/jobs/job-kept").json()["stdout"] == "kept\n"
        filler.unlink()
        retried = http.post(f"/sandboxes/{sid}/exec", json={"command": counter, "wait": True, "job_id": "job-retried"})
        assert retried.status_code == 200, retried.text
        assert retried.json()["stdout"].startswith("1\n")  # ran once, whatever the retries
        assert http.get("/jobs/job-retried").json()["status"] == "succeeded"
        assert http.post("/sandboxes", json={}).json()["status"] == "ready"
        listed = {s["sandbox_id"]: s["status"] for s in http.get("/sandboxes").json()["sandboxes"]}
        assert listed[sid] == "ready" and len(listed) == 2, listed  # the refused create left no record
    assert server.process.poll() is None
    server.kill9()
    db = sqlite3.connect(str(small_state_disk / "server.db"))
    assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    db.close()
    server.start()
    with server.http() as http:
        assert http.get("/jobs/job-kept").json()["stdout"] == "kept\n"
        assert http.get("/jobs/job-retried").json()["stdout"].startswith("1\n")
        assert http.get(f"/sandboxes/{sid}").json()["status"] == "ready"


def test_heartbeats_during_a_full_disk_are_not_lost(server_factory, small_state_disk):
    """The reconciler cannot write the batch of heartbeats while the disk is full; it keeps
    them for the next round, so a sandbox that was in use is not reaped once space is back."""
    server = server_factory(state=str(small_state_disk / "server.db"),
                            reconciler={"interval": 0.2, "heartbeat_ttl": 3, "lost_grace": 0})
    with server.http() as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        filler = fill(small_state_disk)
        full_since = time.monotonic()
        while time.monotonic() - full_since < 4:  # longer than the TTL: heartbeats that cannot be written
            assert http.post(f"/sandboxes/{sid}/heartbeat").status_code == 200
            _wait_for_a_round(http)
        filler.unlink()
        _wait_for_a_round(http)
        _wait_for_a_round(http)
        assert http.get(f"/sandboxes/{sid}").json()["status"] == "ready"


def _wait_for_a_round(http: httpx.Client) -> None:
    """Until the reconciler has run one more round."""

    def rounds() -> float:
        total = 0.0
        for line in http.get("/metrics").text.splitlines():
            if line.startswith('orchard_reconciler_actions_total{action="round"}'):
                total += float(line.split()[-1])
        return total

    start = rounds()
    deadline = time.monotonic() + 10
    while rounds() <= start:
        assert time.monotonic() < deadline
        time.sleep(0.05)
