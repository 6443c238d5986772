"""The PostgreSQL store against a real PostgreSQL started by the tests (Debian's
``postgresql`` package; ``make test`` installs it): the same records as the SQLite store,
migrations that replicas starting together apply once, and one leader among replicas."""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from orchard.models import Job, Sandbox, SandboxSpec
from orchard.server.store import SandboxRecord

_databases = itertools.count()


def as_postgres(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *argv],
                          capture_output=True, text=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL on a Unix socket of its own (no TCP port to collide on)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        pytest.fail("PostgreSQL is not installed: apt-get install postgresql (make test installs it)")
    bindir = Path(found[-1]).parent
    root = Path(tempfile.mkdtemp(prefix="orchard-pg-", dir="/tmp"))
    shutil.chown(root, "postgres", "postgres")
    init = as_postgres(str(bindir / "initdb"), "-D", str(root / "data"), "-A", "trust", "-U", "postgres", "--no-sync")
    assert init.returncode == 0, init.stderr
    port = str(40000 + os.getpid() % 20000)  # names the socket file only: any value is valid
    start = as_postgres(str(bindir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "log"), "-w", "-o",
                        f"-k {root} -p {port} -c listen_addresses='' -c fsync=off", "start")
    assert start.returncode == 0, start.stderr + (root / "log").read_text(errors="replace")
    try:
        yield f"postgresql://postgres@/postgres?host={root}&port={port}"
    finally:
        as_postgres(str(bindir / "pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def database(postgres_server) -> str:
    """A fresh database per test."""
    import psycopg

    name = f"orchard_test_{next(_databases)}"
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return postgres_server.replace("/postgres?", f"/{name}?")


def record(sandbox_id: str, last_seen: float = 1.0) -> SandboxRecord:
    spec = SandboxSpec(image="host", sandbox_id=sandbox_id)
    return SandboxRecord(spec, Sandbox(sandbox_id=sandbox_id, image="host", status="ready", ready=True), last_seen)


def test_records_round_trip_like_the_sqlite_store(database):
    from orchard.server.postgres import PostgresStore

    store = PostgresStore(database)
    for name in ("b", "a", "c"):
        store.put_sandbox(record(name))
    assert [r.sandbox.sandbox_id for r in store.list_sandboxes()] == ["b", "a", "c"]  # in creation order
    store.put_sandbox(record("a", last_seen=5.0))  # an update keeps its place
    assert [r.sandbox.sandbox_id for r in store.list_sandboxes()] == ["b", "a", "c"]
    store.touch_many({"a": 3.0, "b": 9.0})
    assert store.get_sandbox("a").last_seen == 5.0  # never moved back by a slower replica
    assert store.get_sandbox("b").last_seen == 9.0
    assert store.remove_sandbox("c") is True
    assert store.get_sandbox("c") is None
    assert store.remove_sandbox("c") is False  # already gone: the replica that removed it counts it
    queued = Job(job_id="j1", sandbox_id="a", command="true", status="queued", created_at=1.0)
    store.put_job(queued)
    assert [j.job_id for j in store.unfinished_jobs("a")] == ["j1"]
    store.put_job_json("a", queued.model_copy(update={"status": "succeeded", "exit_code": 0,
                                                      "completed_at": 2.0}).model_dump_json().encode())
    assert store.get_job("j1").status == "succeeded" and store.unfinished_jobs("a") == []
    assert store.purge_jobs(finished_before=10.0) == 1 and store.get_job("j1") is None
    first = store.server_id()
    store.close()
    assert PostgresStore(database).server_id() == first  # stable across restarts and replicas


def test_replicas_starting_together_apply_the_migrations_once(database):
    import psycopg

    from orchard.server.postgres import MIGRATIONS, PostgresStore

    stores, errors = [], []

    def open_one() -> None:
        try:
            stores.append(PostgresStore(database))
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and len(stores) == 4
    with psycopg.connect(database) as db:
        assert db.execute("SELECT version FROM schema_version ORDER BY version").fetchall() == \
            [(v,) for v in range(1, len(MIGRATIONS) + 1)]
    for store in stores:
        store.close()


def test_one_replica_leads_the_reconciler_and_hands_over_when_it_goes(database):
    from orchard.server.postgres import PostgresStore

    first, second = PostgresStore(database), PostgresStore(database)
    assert first.lead("reconciler") and not second.lead("reconciler")
    assert first.lead("reconciler")  # it keeps the role
    first.close()  # the replica dies: its session, and the lock, go with it
    deadline = time.monotonic() + 10
    while not second.lead("reconciler"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second.close()


def test_a_store_url_that_is_not_postgresql_is_refused_by_name():
    from pydantic import ValidationError

    from orchard.server.config import ServerConfig

    with pytest.raises(ValidationError, match="store"):
        ServerConfig(store="mysql://root@db/orchard")


def test_finished_jobs_are_bounded_by_bytes_there_too(database):
    from orchard.server.postgres import PostgresStore
    from tests.server.test_sqlite_store import check_job_bytes_bound

    store = PostgresStore(database)
    try:
        check_job_bytes_bound(store)
    finally:
        store.close()
