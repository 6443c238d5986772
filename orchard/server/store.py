"""Where the server keeps sandbox and job records, so a restart finds them again.

``Store`` is the small interface a shared store implements for several replicas
(``postgres.py``); ``SQLiteStore`` is the default, a file and no server to run.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from pydantic import ValidationError

from orchard.errors import StoreRecordDamaged, StoreUnavailable
from orchard.models import Job, Sandbox, SandboxSpec

log = logging.getLogger(__name__)
CHECKPOINT_SECONDS = 0.5
WAL_KEEP_BYTES = 4 << 20
WAL_RESTART_BYTES = 64 << 20
WAL_STALL_SECONDS = 1.0  # the writer's own truncation waits at most this long for the thread's copy
WAL_STALL_COOLDOWN_SECONDS = 10.0  # and after a wait that ran out, does not wait again for this long
# Finished jobs past the newest ``keep_bytes`` of stored records (each job's output is kept
# as JSON, control bytes escaped, up to about six times the raw bytes), oldest first.
PURGE_PAST_BYTES = """DELETE FROM jobs WHERE job_id IN (
    SELECT job_id FROM (SELECT job_id, SUM({size}) OVER (ORDER BY completed_at DESC, job_id) AS newer
                        FROM jobs WHERE done{done}) AS ranked WHERE newer > {mark})"""
CHECKPOINT_BUSY_SECONDS = 0.25  # how long the thread's truncation waits for the writer or a reader


@dataclass
class SandboxRecord:
    spec: SandboxSpec
    sandbox: Sandbox
    last_seen: float  # the last call on it: heartbeats and every other call count


T = TypeVar("T")
_reported: set[str] = set()  # damaged records already logged (listings run every reconciler round)


def sandbox_record(row: Iterable) -> SandboxRecord:
    """A ``(sandbox_id, spec, sandbox, last_seen)`` row as a record, or StoreRecordDamaged."""
    sandbox_id, spec, sandbox, last_seen = row
    try:
        try:
            parsed = SandboxSpec.model_validate_json(spec)
        except ValidationError:  # stored under older, looser rules: keep it readable and deletable
            parsed = SandboxSpec.model_construct(**json.loads(spec))
        return SandboxRecord(parsed, Sandbox.model_validate_json(sandbox), float(last_seen))
    except (ValueError, TypeError) as exc:  # ValidationError and JSON errors are ValueErrors
        raise StoreRecordDamaged(f"the server's record of sandbox {sandbox_id!r} is damaged: "
                                 f"{type(exc).__name__}") from None


def job_record(row: Iterable) -> Job:
    """A ``(job_id, job)`` row as a job, or StoreRecordDamaged."""
    job_id, text = row
    try:
        return Job.model_validate_json(text)
    except ValueError as exc:
        raise StoreRecordDamaged(f"the server's record of job {job_id!r} is damaged: {type(exc).__name__}") from None


def readable(rows: Iterable, decode: Callable[[Iterable], T]) -> list[T]:
    """Every row that can be read; a damaged one is skipped (and logged once), so it cannot
    take a listing, or the reconciler's rounds, down with it."""
    found = []
    for row in rows:
        try:
            found.append(decode(row))
        except StoreRecordDamaged as exc:
            if exc.message not in _reported:
                _reported.add(exc.message)
                log.error("%s; skipped in listings", exc.message)
    return found


class Store(ABC):
    @abstractmethod
    def server_id(self) -> str:
        """A stable id of this deployment, to tell its sandboxes from others' on a shared backend."""

    @abstractmethod
    def put_sandbox(self, record: SandboxRecord) -> None: ...

    @abstractmethod
    def get_sandbox(self, sandbox_id: str) -> Optional[SandboxRecord]: ...

    @abstractmethod
    def list_sandboxes(self) -> list[SandboxRecord]: ...

    @abstractmethod
    def touch_many(self, last_seen: dict[str, float]) -> None:
        """Record the last call on each sandbox (a batch, written once per reconciler round)."""

    @abstractmethod
    def remove_sandbox(self, sandbox_id: str) -> bool:
        """Whether this call removed the record (False: it was already gone, e.g. removed by
        another replica on a shared store)."""

    @abstractmethod
    def put_job(self, job: Job) -> None: ...

    @abstractmethod
    def put_job_json(self, sandbox_id: str, job_json: bytes) -> None:
        """Store a finished job as the agent answered it (the hot path skips a parse)."""

    @abstractmethod
    def get_job(self, job_id: str) -> Optional[Job]: ...

    @abstractmethod
    def unfinished_jobs(self, sandbox_id: str) -> list[Job]: ...

    @abstractmethod
    def purge_jobs(self, finished_before: float, keep_bytes: Optional[int] = None) -> int:
        """Remove finished jobs completed before ``finished_before``, then the oldest finished
        ones past the newest ``keep_bytes`` of records; returns how many went."""

    def claim(self, name: str) -> bool:
        """Hold ``name`` (a sandbox being created) for this server until ``release``: False
        while another replica holds it, and a replica that dies lets go of what it held.
        Alone: always True (one server's own callers are serialized in the service)."""
        return True

    def release(self, name: str) -> None:
        """Let go of a name taken with ``claim``."""

    def lead(self, role: str) -> bool:
        """Whether this server does ``role``'s work now (the reconciler's reaping): with
        several replicas on one shared store, one of them at a time. Alone: always."""
        return True

    @abstractmethod
    def close(self) -> None: ...


SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id TEXT PRIMARY KEY, spec TEXT NOT NULL, sandbox TEXT NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, done INTEGER NOT NULL, completed_at REAL,
    job TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_by_sandbox ON jobs (sandbox_id, done);
CREATE INDEX IF NOT EXISTS jobs_by_completion ON jobs (done, completed_at);
"""


def _guarded(call: Callable[..., T], *args: object) -> T:
    try:
        return call(*args)
    except sqlite3.DatabaseError as exc:
        raise StoreUnavailable(f"the server's state store failed: {exc}") from exc


def _text(value: bytes) -> "str | bytes":
    """A text column as str; one that is not UTF-8 (bit rot) stays bytes, so only its own row
    fails to parse (StoreRecordDamaged, skipped in listings), not the statement that read it."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value


class _Rows:
    """A statement's rows, whose later steps fail as StoreUnavailable too: SQLite reads a page
    only when a step reaches it, so a damaged page past a query's first rows is met in
    ``fetchall``, not in ``execute``."""

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self.cursor = cursor

    @property
    def rowcount(self) -> int:
        return self.cursor.rowcount

    def fetchone(self) -> Any:
        return _guarded(self.cursor.fetchone)

    def fetchall(self) -> list[Any]:
        return _guarded(self.cursor.fetchall)


class _Database:
    """A SQLite connection whose errors (disk full, I/O errors, a locked file, a damaged page)
    are the typed, retryable StoreUnavailable: each statement is its own transaction, so a
    failed one changed nothing, and the caller hears a 503 instead of a 500 and a dropped connection."""

    def __init__(self, path: Path, busy_seconds: float = 5.0) -> None:
        self.connection = _guarded(functools.partial(sqlite3.connect, timeout=busy_seconds, isolation_level=None,
                                                     check_same_thread=False), str(path))
        self.connection.text_factory = _text

    def execute(self, *args: object) -> _Rows:
        return _Rows(_guarded(self.connection.execute, *args))

    def executemany(self, *args: object) -> _Rows:
        return _Rows(_guarded(self.connection.executemany, *args))

    def executescript(self, script: str) -> _Rows:
        return _Rows(_guarded(self.connection.executescript, script))

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Several statements as one commit (one WAL append instead of one per statement);
        if any of them, or the commit, fails, none of them is kept."""
        try:  # BEGIN inside: an exception right after it (a signal) must not leave it open
            self.execute("BEGIN IMMEDIATE")
            yield
            self.execute("COMMIT")
        except BaseException:
            if self.connection.in_transaction:
                with suppress(sqlite3.Error):  # the first error is the one to report
                    self.connection.rollback()
            raise

    def close(self) -> None:
        self.connection.close()


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


class _Checkpointer:
    """Copies the WAL into the database file from its own thread and connection.

    A checkpoint syncs the file to disk: on our machines that took up to 300 ms, and SQLite's
    automatic checkpoint runs inside whichever commit crosses its threshold, so one exec in
    a few hundred stalled the server's whole event loop for it. A passive checkpoint here never
    blocks the server's writes, and the WAL restarts from its start once fully copied. Under a
    steady stream of writes it never is (a commit lands during each checkpoint's sync, and the
    WAL grew by about 10 MB/s at 400 writes/s): past ``restart_bytes`` the checkpoint waits for
    the writer and truncates the WAL, a stall of one sync in that many bytes of writes (and
    past twice that, the writer truncates it itself: ``_WalLimit``). A reader holding an old
    snapshot fails that truncation only after ``CHECKPOINT_BUSY_SECONDS``, which the writer
    waits through; so after one such failure the thread truncates again only once a passive
    checkpoint has copied every frame (a reader that renews its snapshot can pass that test
    now and then, and costs a stall each time)."""

    def __init__(self, path: Path, interval: float = CHECKPOINT_SECONDS,
                 restart_bytes: int = WAL_RESTART_BYTES) -> None:
        self.path, self.interval, self.restart_bytes = path, interval, restart_bytes
        self.wal = f"{path}-wal"
        self.pinned = False  # the last truncation failed: a reader (or the writer) held on
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="orchard-sqlite-checkpoint", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        connection = sqlite3.connect(str(self.path), timeout=CHECKPOINT_BUSY_SECONDS, isolation_level=None,
                                     check_same_thread=False)
        try:
            while not self.stopping.wait(self.interval):
                try:
                    self.round(connection)
                except sqlite3.DatabaseError as exc:  # disk full, I/O error: the next round tries again
                    log.warning("state store checkpoint failed: %s", exc)
        finally:
            connection.close()

    def round(self, connection: sqlite3.Connection) -> None:
        _, frames, copied = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if frames >= 0:  # -1: another checkpoint held the lock, which says nothing of readers
            self.pinned = self.pinned and copied < frames
        if not self.pinned and _size(self.wal) > self.restart_bytes:  # after the passive copy: a short stall
            busy, _, _ = connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            self.pinned = bool(busy)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(30)


class _WalLimit:
    """Backpressure for when the checkpoint thread falls behind (starved of CPU, the WAL
    reached 62 MB against a 48 MB bound at load 31): after any write that leaves the WAL past
    ``limit_bytes``, the writer truncates it itself, on a connection of its own that never
    waits for a lock. While the thread's copy is in flight it retries, for at most
    ``WAL_STALL_SECONDS``; a wait that runs out (a thread descheduled mid-copy, a slow disk)
    makes the next ``WAL_STALL_COOLDOWN_SECONDS`` try once each and move on, so the writer
    spends at most about a tenth of its time waiting here (a truncation it wins also copies
    and syncs the WAL itself: 330 ms for 128 MiB here). A reader holding an old snapshot
    makes it give up at once, since no truncation can pass that reader. A truncating
    checkpoint of another connection holds the write lock too: then the write itself waits
    (the main connection's busy timeout, 5 s, then StoreUnavailable), not this."""

    def __init__(self, path: Path, limit_bytes: int) -> None:
        self.wal, self.limit_bytes = f"{path}-wal", limit_bytes
        self.db = _Database(path, busy_seconds=0)
        self.patient_from = 0.0  # the monotonic time from which a wait is allowed again

    def written(self) -> None:
        if _size(self.wal) <= self.limit_bytes:
            return
        began = time.monotonic()
        patient = began >= self.patient_from
        deadline = began + (WAL_STALL_SECONDS if patient else 0.0)
        try:
            while True:
                busy, frames, _ = self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                if not busy or frames >= 0 or time.monotonic() >= deadline:
                    break  # done, a reader holds the WAL (-1 frames: another checkpoint has it), or waited enough
                time.sleep(0.005)
        except StoreUnavailable as exc:  # disk full: the write itself landed; the next one tries again
            log.warning("state store checkpoint failed: %s", exc)
        if time.monotonic() - began > WAL_STALL_SECONDS / 10:  # a wait, however it ended
            self.patient_from = time.monotonic() + WAL_STALL_COOLDOWN_SECONDS

    def close(self) -> None:
        self.db.close()


class SQLiteStore(Store):
    """One SQLite file in WAL mode; every call is a short local transaction, and no commit
    ever waits for a disk sync (``_Checkpointer``)."""

    def __init__(self, path: Path, checkpoint_seconds: float = CHECKPOINT_SECONDS,
                 wal_restart_bytes: int = WAL_RESTART_BYTES) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = _Database(path)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # in WAL mode: syncs at checkpoints only
        self.db.execute("PRAGMA wal_autocheckpoint=0")
        self.db.execute(f"PRAGMA journal_size_limit={WAL_KEEP_BYTES}")  # a reused WAL is cut back to this
        self.db.executescript(SCHEMA)
        path.chmod(0o600)
        self.checkpointer = _Checkpointer(path, checkpoint_seconds, wal_restart_bytes)
        self.wal_limit = _WalLimit(path, 2 * wal_restart_bytes)

    def server_id(self) -> str:
        row = self.db.execute("SELECT value FROM meta WHERE key='server_id'").fetchone()
        if row:
            return row[0]
        value = secrets.token_hex(6)
        self.db.execute("INSERT OR IGNORE INTO meta VALUES ('server_id', ?)", (value,))
        return self.server_id()

    def put_sandbox(self, record: SandboxRecord) -> None:
        self.db.execute("INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?)",
                        (record.sandbox.sandbox_id, record.spec.model_dump_json(), record.sandbox.model_dump_json(),
                         record.last_seen))
        self.wal_limit.written()

    def get_sandbox(self, sandbox_id: str) -> Optional[SandboxRecord]:
        row = self.db.execute("SELECT sandbox_id, spec, sandbox, last_seen FROM sandboxes WHERE sandbox_id=?",
                              (sandbox_id,)).fetchone()
        return sandbox_record(row) if row else None

    def list_sandboxes(self) -> list[SandboxRecord]:
        rows = self.db.execute("SELECT sandbox_id, spec, sandbox, last_seen FROM sandboxes ORDER BY rowid").fetchall()
        return readable(rows, sandbox_record)

    def touch_many(self, last_seen: dict[str, float]) -> None:
        if last_seen:
            with self.db.transaction():  # one commit: alone, each row's page was a WAL frame (3.9 MiB for 1,000)
                self.db.executemany("UPDATE sandboxes SET last_seen=? WHERE sandbox_id=?",
                                    [(when, sandbox_id) for sandbox_id, when in last_seen.items()])
            self.wal_limit.written()

    def remove_sandbox(self, sandbox_id: str) -> bool:
        removed = self.db.execute("DELETE FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).rowcount > 0
        self.wal_limit.written()
        return removed

    def put_job(self, job: Job) -> None:
        self.db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?)",
                        (job.job_id, job.sandbox_id, int(job.done), job.completed_at, job.model_dump_json()))
        self.wal_limit.written()

    def put_job_json(self, sandbox_id: str, job_json: bytes) -> None:
        fields = json.loads(job_json)
        done = fields.get("status") in ("succeeded", "failed")
        self.db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?)",
                        (fields["job_id"], sandbox_id, int(done), fields.get("completed_at"), job_json.decode()))
        self.wal_limit.written()

    def get_job(self, job_id: str) -> Optional[Job]:
        row = self.db.execute("SELECT job_id, job FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return job_record(row) if row else None

    def unfinished_jobs(self, sandbox_id: str) -> list[Job]:
        rows = self.db.execute("SELECT job_id, job FROM jobs WHERE sandbox_id=? AND done=0", (sandbox_id,)).fetchall()
        return readable(rows, job_record)

    def purge_jobs(self, finished_before: float, keep_bytes: Optional[int] = None) -> int:
        purged = self.db.execute("DELETE FROM jobs WHERE done=1 AND completed_at < ?", (finished_before,)).rowcount
        if keep_bytes is not None:
            purged += self.db.execute(PURGE_PAST_BYTES.format(size="length(CAST(job AS BLOB))", done="=1", mark="?"),
                                      (keep_bytes,)).rowcount
        self.wal_limit.written()
        return purged

    def close(self) -> None:
        self.checkpointer.stop()
        self.wal_limit.close()
        self.db.close()  # the last connection to close checkpoints what is left

