"""Writes beside an outside reader that pins the state store's WAL (an operator's `sqlite3`
shell in a transaction): 20 kB jobs for 6 s on the default settings; how many landed and how
long the writer stalled. Run: `.venv/bin/python docs/probes/wal_beside_a_reader.py`."""

import json
import sqlite3
import tempfile
import time
from pathlib import Path

from orchard.server.store import SQLiteStore


def job(n: int) -> bytes:
    return json.dumps({"job_id": f"job-{n}", "sandbox_id": "sb", "command": "true", "status": "succeeded",
                       "stdout": "x" * 20000, "exit_code": 0, "created_at": 1.0, "completed_at": 1.0}).encode()


def main() -> None:
    db = Path(tempfile.mkdtemp()) / "server.db"
    store = SQLiteStore(db)
    store.put_job_json("sb", job(-1))
    reader = sqlite3.connect(str(db), isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM jobs").fetchone()  # holds this snapshot until it ends
    latencies, end = [], time.monotonic() + 6
    while time.monotonic() < end:
        started = time.monotonic()
        store.put_job_json("sb", job(len(latencies)))
        latencies.append(time.monotonic() - started)
    stalls = [x for x in latencies if x > 0.1]
    print(f"{len(latencies)} writes; slowest {max(latencies) * 1000:.0f} ms; {len(stalls)} over 100 ms, "
          f"{sum(stalls):.2f} s in all")
    reader.close()
    store.close()


if __name__ == "__main__":
    main()
