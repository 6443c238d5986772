"""A PostgreSQL store, for several server replicas sharing one set of records.

Same interface as the SQLite store (``store.py``); the schema is created and upgraded by
numbered migrations, applied under an advisory lock so replicas starting together never
race. Work that one replica at a time must do (the reconciler's reaping) is led through
``lead``, and a sandbox being created is held through ``claim``: both are session-level
advisory locks, held as long as this replica's connection lives, so a replica that dies
hands them over without anyone cleaning up after it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from typing import Any, Optional

from orchard.models import Job
from orchard.server.store import SandboxRecord, SQLiteStore, Store

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


def lock_id(role: str) -> int:
    """A signed 64-bit advisory lock id for a role name."""
    return int.from_bytes(hashlib.sha256(f"orchard:{role}".encode()).digest()[:8], "big", signed=True)


class PostgresStore(Store):
    """One connection (autocommit) per server, calls serialized: each is one short statement."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.db = psycopg.connect(url, autocommit=True)
        self._lock = threading.Lock()
        self._led: set[str] = set()
        self.migrate()

    def _run(self, sql: str, params: Any = None) -> Any:
        with self._lock:
            return self.db.execute(sql, params)

    def migrate(self) -> int:
        """Apply the migrations this database lacks; returns the schema version."""
        with self._lock, self.db.transaction():
            self.db.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = self.db.execute("SELECT max(version) FROM schema_version").fetchone()
            current = row[0] or 0
            for version, sql in enumerate(MIGRATIONS, start=1):
                if version > current:
                    self.db.execute(sql)
                    self.db.execute("INSERT INTO schema_version VALUES (%s)", (version,))
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
        row = self._run("SELECT spec, sandbox, last_seen FROM sandboxes WHERE sandbox_id = %s",
                        (sandbox_id,)).fetchone()
        return SQLiteStore._record(row) if row else None

    def list_sandboxes(self) -> list[SandboxRecord]:
        rows = self._run("SELECT spec, sandbox, last_seen FROM sandboxes ORDER BY created").fetchall()
        return [SQLiteStore._record(row) for row in rows]

    def touch_many(self, last_seen: dict[str, float]) -> None:
        if last_seen:  # later calls win: a replica never moves a sandbox's last call back in time
            with self._lock, self.db.cursor() as cursor:
                cursor.executemany("UPDATE sandboxes SET last_seen = greatest(last_seen, %s) WHERE sandbox_id = %s",
                                   [(when, sandbox_id) for sandbox_id, when in last_seen.items()])

    def remove_sandbox(self, sandbox_id: str) -> None:
        self._run("DELETE FROM sandboxes WHERE sandbox_id = %s", (sandbox_id,))

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
        row = self._run("SELECT job FROM jobs WHERE job_id = %s", (job_id,)).fetchone()
        return Job.model_validate_json(row[0]) if row else None

    def unfinished_jobs(self, sandbox_id: str) -> list[Job]:
        rows = self._run("SELECT job FROM jobs WHERE sandbox_id = %s AND NOT done", (sandbox_id,)).fetchall()
        return [Job.model_validate_json(row[0]) for row in rows]

    def purge_jobs(self, finished_before: float) -> int:
        return self._run("DELETE FROM jobs WHERE done AND completed_at < %s", (finished_before,)).rowcount

    def claim(self, name: str) -> bool:
        return self._run("SELECT pg_try_advisory_lock(%s)", (lock_id(f"claim:{name}"),)).fetchone()[0]

    def release(self, name: str) -> None:
        self._run("SELECT pg_advisory_unlock(%s)", (lock_id(f"claim:{name}"),))

    def lead(self, role: str) -> bool:
        if role not in self._led and self._run("SELECT pg_try_advisory_lock(%s)", (lock_id(role),)).fetchone()[0]:
            self._led.add(role)
        return role in self._led

    def close(self) -> None:
        self.db.close()  # our advisory locks go with the session: another replica leads
