"""The SQLite state store: no commit waits for a disk sync; a thread of its own checkpoints.

SQLite's automatic checkpoint syncs the database inside whichever commit crosses its
threshold; on our machines that took up to 300 ms, with the server's whole event loop
waiting. Commits now only append to the WAL, which a background connection copies into
the database file.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchard.errors import StoreUnavailable
from orchard.models import Sandbox, SandboxSpec
from orchard.server.store import WAL_KEEP_BYTES, SandboxRecord, SQLiteStore

JOBS = 2000


def _job(n: int) -> bytes:
    return json.dumps({"job_id": f"job-{n:06d}", "sandbox_id": "sb", "command": "true", "status": "succeeded",
                       "stdout": "x" * 1000, "exit_code": 0, "created_at": 1.0, "completed_at": 1.0}).encode()


def test_commits_never_checkpoint_and_close_keeps_everything(tmp_path: Path):
    db = tmp_path / "server.db"
    store = SQLiteStore(db, checkpoint_seconds=3600)  # the background checkpoint never comes
    assert store.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    schema_only = db.stat().st_size
    for n in range(JOBS):
        store.put_job_json("sb", _job(n))
    assert db.stat().st_size == schema_only  # 2 MB of jobs, all still in the WAL: no commit synced
    assert Path(f"{db}-wal").stat().st_size > JOBS * 1000
    store.close()  # the last connection checkpoints what is left
    assert db.stat().st_size > JOBS * 1000
    reopened = SQLiteStore(db)
    try:
        assert reopened.get_job(f"job-{JOBS - 1:06d}").stdout == "x" * 1000
        assert len(reopened.db.execute("SELECT job_id FROM jobs").fetchall()) == JOBS
    finally:
        reopened.close()


def test_the_background_checkpoint_copies_the_wal_and_keeps_it_bounded(tmp_path: Path):
    db, wal = tmp_path / "server.db", tmp_path / "server.db-wal"
    store = SQLiteStore(db, checkpoint_seconds=0.05)

    def written_then_copied(first: int, count: int) -> None:
        before = db.stat().st_size
        for n in range(first, first + count):
            store.put_job_json("sb", _job(n))
        deadline = time.monotonic() + 30
        while db.stat().st_size <= before:  # copied into the database file by the checkpointer
            assert time.monotonic() < deadline, "the background checkpoint never ran"
            time.sleep(0.02)

    try:
        written_then_copied(0, JOBS)  # about 20 kB of WAL a job: some 40 MB if nothing were copied
        for batch in range(5):
            written_then_copied(JOBS + batch * 100, 100)
        # A WAL copied in full is reused from its start by the next commit, and cut back. Under
        # load a commit can land inside every checkpoint (then the WAL is never copied in full):
        # a quiet moment, then one commit, until it is.
        extra, deadline = 0, time.monotonic() + 30
        while wal.stat().st_size > 2 * WAL_KEEP_BYTES:
            assert time.monotonic() < deadline, f"the WAL stayed at {wal.stat().st_size} bytes"
            time.sleep(0.2)
            store.put_job_json("sb", _job(JOBS + 500 + extra))
            extra += 1
        assert len(store.db.execute("SELECT job_id FROM jobs").fetchall()) == JOBS + 500 + extra
    finally:
        store.close()
    assert not store.checkpointer.thread.is_alive()


def test_a_steady_stream_of_writes_cannot_grow_the_wal_without_bound(tmp_path: Path):
    """A passive checkpoint never finishes while commits keep landing during its sync, so the
    WAL never restarted and grew by about 10 MB/s at 400 writes/s (found in review); past a
    size the checkpoint now waits for the writer once and truncates it."""
    db, wal = tmp_path / "server.db", tmp_path / "server.db-wal"
    store = SQLiteStore(db, checkpoint_seconds=0.02, wal_restart_bytes=2 * WAL_KEEP_BYTES)
    largest = 0
    try:
        for n in range(6000):  # about 120 MB of WAL, back to back: a commit lands during every sync
            store.put_job_json("sb", _job(n))
            largest = max(largest, wal.stat().st_size if wal.exists() else 0)
    finally:
        store.close()
    assert largest <= 12 * WAL_KEEP_BYTES, largest  # 48 MB; 13-26 MB seen with the fix, 120 MB without


def test_the_wal_stays_bounded_when_the_checkpoint_thread_never_runs(tmp_path: Path):
    """The checkpoint thread starved of CPU (at load 31 the WAL reached 62 MB past the bound
    above): the writer itself truncates the WAL past twice the restart size, after any write
    (it used to look once in 32 writes, and 32 large writes went past the bound), so the bound
    holds whatever the scheduling; here the thread's first round is an hour away."""
    db, wal = tmp_path / "server.db", tmp_path / "server.db-wal"
    restart = 2 * WAL_KEEP_BYTES
    store = SQLiteStore(db, checkpoint_seconds=3600, wal_restart_bytes=restart)
    largest = truncated = 0
    try:
        for n in range(3000):  # about 60 MB of WAL
            before = wal.stat().st_size if wal.exists() else 0
            store.put_job_json("sb", _job(n))
            size = wal.stat().st_size
            largest, truncated = max(largest, size), truncated + (size < before)
        assert store.get_job("job-002999") is not None and store.get_job("job-000000") is not None
    finally:
        store.close()
    per_write = 64 << 10  # a job record and its pages, generously
    assert largest <= 2 * restart + per_write, largest
    assert truncated >= 2, truncated  # it did restart, more than once


def _sandboxes(store: SQLiteStore, count: int) -> list[str]:
    names = [f"sb-{n:05d}" for n in range(count)]
    for name in names:
        store.put_sandbox(SandboxRecord(SandboxSpec(), Sandbox(sandbox_id=name, image="host", status="ready"), 1.0))
    return names


def test_a_heartbeat_batch_is_one_commit_so_its_wal_is_its_pages_not_its_rows(tmp_path: Path):
    """Found in review: each row of a batch of heartbeats was a commit of its own, a WAL frame
    (4 kB) per sandbox: 3.9 MiB a round with 1,000 sandboxes. As one commit it writes each
    page it changed once; and a failed batch keeps none of its rows."""
    db, wal = tmp_path / "server.db", tmp_path / "server.db-wal"
    store = SQLiteStore(db, checkpoint_seconds=3600)
    try:
        names = _sandboxes(store, 1000)
        pages, page_size = (store.db.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "page_size"))
        before = wal.stat().st_size
        store.touch_many({name: 2.0 for name in names})
        grown_frames = (wal.stat().st_size - before) / (page_size + 24)
        assert grown_frames <= pages + 1, (grown_frames, pages)  # without one commit: 1,000 frames
        assert {r.last_seen for r in store.list_sandboxes()} == {2.0}

        with pytest.raises(StoreUnavailable):  # NOT NULL: the batch fails on its last row
            store.touch_many({**{name: 3.0 for name in names[:-1]}, names[-1]: None})
        assert {r.last_seen for r in store.list_sandboxes()} == {2.0}  # none of its rows kept
        assert not store.db.connection.in_transaction
        store.touch_many({names[0]: 4.0})  # and the store goes on
        assert store.get_sandbox(names[0]).last_seen == 4.0
    finally:
        store.close()


def test_a_heartbeat_batch_cannot_take_the_wal_past_its_bound_either(tmp_path: Path):
    """The bound holds for every kind of write, checked after each: batches of heartbeats
    with the checkpoint thread never running."""
    db, wal = tmp_path / "server.db", tmp_path / "server.db-wal"
    restart = 256 << 10
    store = SQLiteStore(db, checkpoint_seconds=3600, wal_restart_bytes=restart)
    largest = 0
    written = store.wal_limit.written

    def measured() -> None:  # the WAL as each write left it, before the writer truncates it
        nonlocal largest
        largest = max(largest, wal.stat().st_size)
        written()

    store.wal_limit.written = measured
    try:
        names = _sandboxes(store, 300)
        batch = 0
        for batch in range(200):
            store.touch_many({name: float(batch) for name in names})
        pages = store.db.execute("PRAGMA page_count").fetchone()[0]
        assert largest <= 2 * restart + (pages + 1) * (4096 + 24), largest
        assert {r.last_seen for r in store.list_sandboxes()} == {float(batch)}
    finally:
        store.close()


def _hold_checkpoint_lock(db: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the WAL's checkpoint lock, as its own checkpoint does while it
    copies (descheduled, or on a slow disk): a POSIX lock on byte 121 of the ``-shm`` file,
    where SQLite's WAL index keeps its checkpoint lock (https://sqlite.org/walformat.html).
    Returns once the lock is held."""
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys, time
            fd = os.open({str(db) + "-shm"!r}, os.O_RDWR)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 121, os.SEEK_SET)
            print("held", flush=True)
            time.sleep({seconds})
        """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def _past_the_limit(store: SQLiteStore, wal: Path, first: int = 0) -> int:
    """Writes jobs from ``first`` on until the WAL is past the writer's limit (which is lifted
    meanwhile, else the write that crosses it truncates it); the next job number."""
    limit, store.wal_limit.limit_bytes = store.wal_limit.limit_bytes, 1 << 40
    n = first
    try:
        while not wal.exists() or wal.stat().st_size <= limit:
            store.put_job_json("sb", _job(n))
            n += 1
    finally:
        store.wal_limit.limit_bytes = limit
    return n


def test_the_writer_waits_for_a_checkpoint_in_flight_but_not_again_and_again(tmp_path: Path):
    """Found in review: the writer's wait for another connection's checkpoint (at most 1 s)
    applied to each attempt, so a checkpoint held for seconds (a descheduled thread, a slow
    disk) stalled the writer nearly all the time: six stalls of 1 s in 6 s. It now waits once,
    then tries once per write, without waiting, for the next ten seconds."""
    from orchard.server.store import WAL_STALL_COOLDOWN_SECONDS, WAL_STALL_SECONDS

    db, wal = tmp_path / "server.db", tmp_path / "server.db-wal"
    store = SQLiteStore(db, checkpoint_seconds=3600, wal_restart_bytes=64 << 10)
    try:
        n = _past_the_limit(store, wal)
        # A checkpoint in flight for a moment: the writer waits for it, then truncates.
        holder = _hold_checkpoint_lock(db, 0.3)
        started = time.monotonic()
        store.put_job_json("sb", _job(n))
        assert wal.stat().st_size == 0 and time.monotonic() - started < WAL_STALL_SECONDS
        assert store.wal_limit.patient_from > time.monotonic()  # any wait starts the cooldown
        holder.wait()
        n = _past_the_limit(store, wal, n + 1)
        store.wal_limit.patient_from = 0.0  # ten seconds later
        # One that stays: one wait of WAL_STALL_SECONDS, then none for the cooldown.
        holder = _hold_checkpoint_lock(db, 60)
        try:
            waits = []
            for _ in range(8):
                started = time.monotonic()
                store.put_job_json("sb", _job(n))
                waits.append(time.monotonic() - started)
                n += 1
            assert waits[0] >= WAL_STALL_SECONDS, waits
            assert sum(waits[1:]) < 0.5, waits  # without the cooldown: 1 s each
            assert store.wal_limit.patient_from > time.monotonic() + WAL_STALL_COOLDOWN_SECONDS - 5
        finally:
            holder.kill()
            holder.wait()
        store.put_job_json("sb", _job(n))  # in the cooldown it still tries, once: the lock is gone
        assert wal.stat().st_size == 0
    finally:
        store.close()


def test_the_writer_never_waits_for_a_reader_to_let_the_wal_be_truncated(tmp_path: Path):
    """Found in review: the writer's own truncation waited for the connection's busy timeout
    (5 s) whenever a reader held an old snapshot, with the server's event loop stopped. It now
    truncates on a connection of its own that never waits for a lock: beside such a reader,
    each write past the limit makes exactly one attempt, which fails at once, and the main
    connection's busy timeout is never touched."""
    db, wal = tmp_path / "server.db", tmp_path / "server.db-wal"
    store = SQLiteStore(db, checkpoint_seconds=3600, wal_restart_bytes=64 << 10)
    assert store.wal_limit.db.execute("PRAGMA busy_timeout").fetchone()[0] == 0
    main_statements: list[str] = []
    limit_statements: list[str] = []
    store.db.connection.set_trace_callback(main_statements.append)
    store.wal_limit.db.connection.set_trace_callback(limit_statements.append)
    reader = sqlite3.connect(str(db), isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM jobs").fetchone()  # holds its snapshot: no truncation can finish
        n = _past_the_limit(store, wal)
        limit_statements.clear()
        for _ in range(20):
            store.put_job_json("sb", _job(n))
            n += 1
        assert limit_statements == ["PRAGMA wal_checkpoint(TRUNCATE)"] * 20
        assert not any("busy_timeout" in statement for statement in main_statements)
        assert store.db.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
        reader.close()
        store.put_job_json("sb", _job(n))
        assert wal.stat().st_size == 0  # the reader gone, the next write truncates
    finally:
        reader.close()
        store.close()


def test_after_a_reader_fails_its_truncation_the_thread_waits_until_the_reader_lets_go(tmp_path: Path):
    """Found in review: beside an outside reader holding an old snapshot, the checkpoint
    thread's truncation stalled every write for 0.25-0.33 s each round (a third of the time),
    and could never succeed. After one failure it now truncates again only once a passive
    checkpoint has copied every frame."""
    db, wal = tmp_path / "server.db", tmp_path / "server.db-wal"
    store = SQLiteStore(db, checkpoint_seconds=3600, wal_restart_bytes=64 << 10)
    checkpoints: list[str] = []
    connection = sqlite3.connect(str(db), timeout=0.05, isolation_level=None)
    connection.set_trace_callback(checkpoints.append)
    reader = sqlite3.connect(str(db), isolation_level=None)
    try:
        store.put_job_json("sb", _job(0))
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM jobs").fetchone()
        for n in range(1, 20):  # past the restart size, behind the reader's snapshot
            store.put_job_json("sb", _job(n))
        for _ in range(3):
            store.checkpointer.round(connection)
        assert checkpoints.count("PRAGMA wal_checkpoint(TRUNCATE)") == 1, checkpoints
        assert store.checkpointer.pinned
        holder = _hold_checkpoint_lock(db, 60)  # a passive round that finds the lock taken says nothing of readers
        try:
            store.checkpointer.round(connection)
        finally:
            holder.kill()
            holder.wait()
        store.checkpointer.round(connection)
        assert checkpoints.count("PRAGMA wal_checkpoint(TRUNCATE)") == 1 and store.checkpointer.pinned
        reader.close()
        store.checkpointer.round(connection)
        assert checkpoints.count("PRAGMA wal_checkpoint(TRUNCATE)") == 2 and not store.checkpointer.pinned
        assert wal.stat().st_size == 0
    finally:
        reader.close()
        connection.close()
        store.close()


def test_a_record_that_is_not_utf8_fails_alone_and_a_bad_state_path_is_a_typed_error(tmp_path: Path):
    """One flipped high bit in a record's JSON: SQLite hands back text that is not UTF-8. Only
    that record is damaged (StoreRecordDamaged, skipped in listings); the statement reading it,
    and the records beside it, are fine."""
    from orchard.errors import StoreRecordDamaged

    store = SQLiteStore(tmp_path / "server.db")
    try:
        for name in ("sb-0", "sb-1", "sb-2"):
            store.put_sandbox(SandboxRecord(SandboxSpec(), Sandbox(sandbox_id=name, image="host", status="ready"), 1.0))
        store.put_job_json("sb-0", _job(1))
        store.db.execute("UPDATE sandboxes SET sandbox = CAST(X'7B2273616E64626F785F6964223A2022FF227D' AS TEXT) "
                         "WHERE sandbox_id = 'sb-1'")
        store.db.execute("UPDATE jobs SET job = CAST(X'7BFE7D' AS TEXT) WHERE job_id = 'job-000001'")
        assert [r.sandbox.sandbox_id for r in store.list_sandboxes()] == ["sb-0", "sb-2"]
        with pytest.raises(StoreRecordDamaged, match="sb-1"):
            store.get_sandbox("sb-1")
        with pytest.raises(StoreRecordDamaged, match="job-000001"):
            store.get_job("job-000001")
        assert store.get_sandbox("sb-2").sandbox.status == "ready"
    finally:
        store.close()
    (tmp_path / "a-directory").mkdir()
    with pytest.raises(StoreUnavailable, match="unable to open"):
        SQLiteStore(tmp_path / "a-directory")


def finished_job(n: int, completed_at: float, output: int = 1000) -> bytes:
    return json.dumps({"job_id": f"job-{n:06d}", "sandbox_id": "sb", "command": "true", "status": "succeeded",
                       "stdout": "\x01" * output, "exit_code": 0, "created_at": 1.0,
                       "completed_at": completed_at}).encode()


def check_job_bytes_bound(store) -> None:
    """The oldest finished jobs go past ``keep_bytes``; unfinished ones and the newest stay.
    Output with control bytes is stored escaped (\\u0001: six bytes each), which counts."""
    for n in range(20):
        store.put_job_json("sb", finished_job(n, completed_at=100.0 + n))
    store.put_job_json("sb", json.dumps({"job_id": "running", "sandbox_id": "sb", "command": "sleep 9",
                                         "status": "running", "created_at": 1.0}).encode())
    one = len(finished_job(0, 100.0).decode().encode()) + 5 * 1000  # the stored, escaped size, about
    purged = store.purge_jobs(finished_before=0.0, keep_bytes=5 * one)
    kept = [n for n in range(20) if store.get_job(f"job-{n:06d}") is not None]
    assert 10 <= purged <= 16 and kept == list(range(20 - len(kept), 20)) and 4 <= len(kept) <= 10, (purged, kept)
    assert store.get_job("running") is not None


def test_finished_jobs_are_bounded_by_bytes_not_only_by_age(tmp_path: Path):
    store = SQLiteStore(tmp_path / "s.db")
    try:
        check_job_bytes_bound(store)
    finally:
        store.close()
