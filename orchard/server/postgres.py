"""A PostgreSQL store, for several server replicas sharing one set of records.

Same interface as the SQLite store (``store.py``); the schema is created and upgraded by
numbered migrations, applied under an advisory lock so replicas starting together never
race. Work that one replica at a time must do (the reconciler's reaping) is led through
``lead``, and a sandbox being created is held through ``claim``: both are session-level
advisory locks, held as long as this replica's connection lives, so a replica that dies
hands them over without anyone cleaning up after it.

The connection can be cut under a live replica (a PostgreSQL restart or failover,
``pg_terminate_backend``, a firewall dropping an idle connection). The call that finds it
cut fails with ``StoreUnavailable`` (503, retryable: every statement is its own
transaction and every write here can be repeated), the session's advisory locks are
forgotten, because PostgreSQL ended them with the session (another replica may lead or
claim by now), and the next call opens a new connection; while PostgreSQL stays away,
calls fail at once with the same 503 and connection attempts are spaced out.

PostgreSQL can also stop answering without cutting anything (a hung or stopped server, a
partition that drops packets): a statement would then wait for ever, and with it the
server, whose store calls are synchronous. A watchdog shuts the connection's socket down
once a call has taken ``call_timeout`` seconds; the call fails as a cut one (503, locks
forgotten: PostgreSQL ends the session when it sees the socket closed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import psycopg
from psycopg.conninfo import conninfo_to_dict

from orchard.errors import StoreUnavailable
from orchard.models import Job
from orchard.server.store import PURGE_PAST_BYTES, SandboxRecord, Store, job_record, readable, sandbox_record

log = logging.getLogger("orchard.server.postgres")

MIGRATIONS = (
    # 1: the records of the SQLite store
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE sandboxes (sandbox_id TEXT PRIMARY KEY, spec TEXT NOT NULL, sandbox TEXT NOT NULL,
                            last_seen DOUBLE PRECISION NOT NULL, created BIGSERIAL);
    CREATE TABLE jobs (job_id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, done BOOLEAN NOT NULL,
                       completed_at DOUBLE PRECISION, job TEXT NOT NULL);
    CREATE INDEX jobs_by_sandbox ON jobs (sandbox_id, done);
    CREATE INDEX jobs_by_completion ON jobs (done, completed_at);
    """,
)
MIGRATION_LOCK = 0x6F72636861726401  # "orchard" + 1: one advisory lock id for schema changes
CONNECT_TIMEOUT = 3  # seconds (libpq's connect_timeout) unless the URL says: a connect blocks the server's loop
# PostgreSQL's operational errors (SQLSTATE classes 08, 53, 57, 40...) and writes refused by a
# server that is (still, or now) a read-only standby: conditions that pass, not bugs
TRANSIENT_ERRORS = (psycopg.OperationalError, psycopg.errors.ReadOnlySqlTransaction)
RECONNECT_BACKOFF = (0.1, 2.0)  # seconds between connection attempts while PostgreSQL is away: first, most


def lock_id(role: str) -> int:
    """A signed 64-bit advisory lock id for a role name."""
    return int.from_bytes(hashlib.sha256(f"orchard:{role}".encode()).digest()[:8], "big", signed=True)


class PostgresStore(Store):
    """One connection (autocommit) per server, calls serialized: each is one short statement.
    A cut connection is opened again by the next call (see the module's docstring)."""

    def __init__(self, url: str, call_timeout: float = 10.0) -> None:
        self.url, self.call_timeout = url, call_timeout
        self._lock = threading.Lock()
        self._watched: Optional[tuple[float, int]] = None  # the call in progress: its deadline, a dup of its socket
        self._watch_lock = threading.Lock()  # a call never ends while the watchdog cuts its socket
        self._closing = threading.Event()
        self._led: set[str] = set()  # roles whose lock this session holds
        self._claims: dict[str, int] = {}  # names claimed in this session, and how often (the locks stack)
        self._next_attempt = 0.0  # monotonic time before which no connection is attempted
        self._backoff = RECONNECT_BACKOFF[0]
        self.db: Optional[psycopg.Connection] = self._connect()  # at start, a failure stops the server
        self.migrate()
        threading.Thread(target=self._watchdog, name="orchard-pg-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        """Cut the socket of a call that has taken longer than ``call_timeout``."""
        while not self._closing.wait(min(0.25, self.call_timeout / 4)):
            with self._watch_lock:
                if self._watched is not None and time.monotonic() > self._watched[0]:
                    _, fd = self._watched  # the call's own duplicate: now the watchdog's to close
                    self._watched = None
                    log.warning("PostgreSQL store call timed out: cutting its connection",
                                extra={"fields": {"call_timeout": self.call_timeout}})
                    try:
                        with socket.socket(fileno=fd) as stalled:
                            stalled.shutdown(socket.SHUT_RDWR)  # the blocked read returns: the call fails
                    except OSError as exc:  # gone already: the call ended some other way
                        log.warning("PostgreSQL store watchdog: %s", exc)

    def _connect(self) -> psycopg.Connection:
        """A new session; its application_name tells replicas apart in ``pg_stat_activity``."""
        given = conninfo_to_dict(self.url)
        defaults = {"connect_timeout": CONNECT_TIMEOUT, "application_name": f"orchard-serve:{os.getpid()}"}
        return psycopg.connect(self.url, autocommit=True, **{k: v for k, v in defaults.items() if k not in given})

    def _connection(self) -> psycopg.Connection:
        """The open connection, a new one if it was cut (under ``_lock``); StoreUnavailable
        while PostgreSQL cannot be reached, at once between spaced-out attempts."""
        if self.db is not None and not self.db.closed:
            return self.db
        now = time.monotonic()
        if now < self._next_attempt:
            raise StoreUnavailable("the server's PostgreSQL store is unreachable (its connection was lost; "
                                   "connecting again)")
        try:
            self.db = self._connect()
        except psycopg.Error as exc:
            self._next_attempt = now + self._backoff
            self._backoff = min(2 * self._backoff, RECONNECT_BACKOFF[1])
            raise StoreUnavailable(f"the server's PostgreSQL store is unreachable: {exc}") from exc
        self._next_attempt, self._backoff = 0.0, RECONNECT_BACKOFF[0]
        log.warning("PostgreSQL store connected again")
        return self.db

    @contextmanager
    def _session(self, watched: bool = True) -> Iterator[psycopg.Connection]:
        """The connection for one call, under ``_lock``, ``watched`` by the watchdog. PostgreSQL's
        operational errors (a cut connection, shutdown, disk full, deadlock; a read-only
        standby during a failover) become the retryable StoreUnavailable; a cut connection also
        ends what the session held."""
        with self._lock:
            db = self._connection()
            try:
                if watched:  # a duplicate of the socket's descriptor, never libpq's number itself: libpq closes
                    # that when it drops the connection (or close() does), and another socket may get it
                    sock = os.dup(db.pgconn.socket)
                    with self._watch_lock:
                        self._watched = (time.monotonic() + self.call_timeout, sock)
                yield db
            except psycopg.Error as exc:
                self._unwatch()
                if db.closed:
                    self._session_lost(db, exc)
                elif not isinstance(exc, TRANSIENT_ERRORS):
                    raise  # a bug (bad SQL, a constraint): a 500 that says so
                raise StoreUnavailable(f"the server's PostgreSQL store failed: {exc}") from exc
            finally:
                self._unwatch()

    def _unwatch(self) -> None:
        with self._watch_lock:
            watched, self._watched = self._watched, None
        if watched is not None:  # else none, or the watchdog took it (and closes it)
            os.close(watched[1])

    def _session_lost(self, db: psycopg.Connection, exc: BaseException) -> None:
        """Forget the advisory locks: PostgreSQL released them with the session, so another
        replica may lead or be creating those sandboxes by now (under ``_lock``)."""
        led, self._led = self._led, set()
        self._claims.clear()
        db.close()
        self.db = None
        log.warning("PostgreSQL store connection lost", extra={"fields": {
            "error": f"{type(exc).__name__}: {exc}".strip(), "leading": sorted(led)}})
        for role in sorted(led):
            log.warning("lead lost", extra={"fields": {"role": role, "reason": "its PostgreSQL session ended"}})

    def _run(self, sql: str, params: Any = None) -> Any:
        with self._session() as db:
            return db.execute(sql, params)

    def migrate(self) -> int:
        """Apply the migrations this database lacks; returns the schema version."""
        with self._session(watched=False) as db, db.transaction():  # may wait for another replica's
            db.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT max(version) FROM schema_version").fetchone()
            current = row[0] or 0
            for version, sql in enumerate(MIGRATIONS, start=1):
                if version > current:
                    db.execute(sql)
                    db.execute("INSERT INTO schema_version VALUES (%s)", (version,))
            return len(MIGRATIONS)

    def server_id(self) -> str:
        self._run("INSERT INTO meta VALUES ('server_id', %s) ON CONFLICT DO NOTHING", (secrets.token_hex(6),))
        return self._run("SELECT value FROM meta WHERE key = 'server_id'").fetchone()[0]

    def put_sandbox(self, record: SandboxRecord) -> None:
        self._run("INSERT INTO sandboxes (sandbox_id, spec, sandbox, last_seen) VALUES (%s, %s, %s, %s) "
                  "ON CONFLICT (sandbox_id) DO UPDATE SET spec = EXCLUDED.spec, sandbox = EXCLUDED.sandbox, "
                  "last_seen = EXCLUDED.last_seen",
                  (record.sandbox.sandbox_id, record.spec.model_dump_json(), record.sandbox.model_dump_json(),
                   record.last_seen))

    def get_sandbox(self, sandbox_id: str) -> Optional[SandboxRecord]:
        row = self._run("SELECT sandbox_id, spec, sandbox, last_seen FROM sandboxes WHERE sandbox_id = %s",
                        (sandbox_id,)).fetchone()
        return sandbox_record(row) if row else None

    def list_sandboxes(self) -> list[SandboxRecord]:
        rows = self._run("SELECT sandbox_id, spec, sandbox, last_seen FROM sandboxes ORDER BY created").fetchall()
        return readable(rows, sandbox_record)

    def touch_many(self, last_seen: dict[str, float]) -> None:
        if last_seen:  # later calls win: a replica never moves a sandbox's last call back in time
            with self._session() as db, db.cursor() as cursor:
                cursor.executemany("UPDATE sandboxes SET last_seen = greatest(last_seen, %s) WHERE sandbox_id = %s",
                                   [(when, sandbox_id) for sandbox_id, when in last_seen.items()])

    def remove_sandbox(self, sandbox_id: str) -> bool:
        return self._run("DELETE FROM sandboxes WHERE sandbox_id = %s", (sandbox_id,)).rowcount > 0

    def _put_job(self, job_id: str, sandbox_id: str, done: bool, completed_at: Optional[float], text: str) -> None:
        self._run("INSERT INTO jobs VALUES (%s, %s, %s, %s, %s) ON CONFLICT (job_id) DO UPDATE SET "
                  "sandbox_id = EXCLUDED.sandbox_id, done = EXCLUDED.done, completed_at = EXCLUDED.completed_at, "
                  "job = EXCLUDED.job", (job_id, sandbox_id, done, completed_at, text))

    def put_job(self, job: Job) -> None:
        self._put_job(job.job_id, job.sandbox_id, job.done, job.completed_at, job.model_dump_json())

    def put_job_json(self, sandbox_id: str, job_json: bytes) -> None:
        fields = json.loads(job_json)
        self._put_job(fields["job_id"], sandbox_id, fields.get("status") in ("succeeded", "failed"),
                      fields.get("completed_at"), job_json.decode())

    def get_job(self, job_id: str) -> Optional[Job]:
        row = self._run("SELECT job_id, job FROM jobs WHERE job_id = %s", (job_id,)).fetchone()
        return job_record(row) if row else None

    def unfinished_jobs(self, sandbox_id: str) -> list[Job]:
        rows = self._run("SELECT job_id, job FROM jobs WHERE sandbox_id = %s AND NOT done", (sandbox_id,)).fetchall()
        return readable(rows, job_record)

    def purge_jobs(self, finished_before: float, keep_bytes: Optional[int] = None) -> int:
        purged = self._run("DELETE FROM jobs WHERE done AND completed_at < %s", (finished_before,)).rowcount
        if keep_bytes is not None:
            purged += self._run(PURGE_PAST_BYTES.format(size="octet_length(job)", done="", mark="%s"),
                                (keep_bytes,)).rowcount
        return purged

    def claim(self, name: str) -> bool:
        with self._session() as db:
            if db.execute("SELECT pg_try_advisory_lock(%s)", (lock_id(f"claim:{name}"),)).fetchone()[0]:
                self._claims[name] = self._claims.get(name, 0) + 1
                return True
            return False

    def release(self, name: str) -> None:
        if name not in self._claims:
            return  # it ended with a cut session: PostgreSQL let it go then (a new session never held it)
        try:
            self._run("SELECT pg_advisory_unlock(%s)", (lock_id(f"claim:{name}"),))
        except StoreUnavailable:
            if name in self._claims:  # the session lives on, and so does the lock
                raise
            return
        self._claims[name] -= 1
        if not self._claims[name]:
            del self._claims[name]

    def lead(self, role: str) -> bool:
        """Leads while the session that took the lock lives: checked with a statement on each
        call, so a replica whose session was cut stops leading before it acts, and takes the
        lead again on a new session only if no other replica took it meanwhile."""
        try:
            if role in self._led:
                self._run("SELECT 1")  # fails, and forgets the lead, if the session was cut
            elif self._run("SELECT pg_try_advisory_lock(%s)", (lock_id(role),)).fetchone()[0]:
                self._led.add(role)
                log.info("lead taken", extra={"fields": {"role": role}})
        except StoreUnavailable:
            return False  # no session, no lead
        return role in self._led

    def close(self) -> None:
        self._closing.set()
        if self.db is not None:
            self.db.close()  # our advisory locks go with the session: another replica leads
