"""The PostgreSQL store loses its connection under a running `orchard serve` (real server
processes, a real PostgreSQL the tests start: the fixtures of tests/server/test_postgres_store.py).

Two faults: the server's backends terminated (``pg_terminate_backend``: what a failover, a
pooler or an idle-connection cut looks like to the server) and PostgreSQL stopped and
started again (a restart: ``pg_ctl stop -m fast``, which ends every session). Each asserts
the observable outcome: every call that needs the store during the outage answers 503
``StoreUnavailable`` (typed, retryable), never a 500; the server connects again by itself
(same process); sandboxes and jobs acknowledged before the cut are all there and usable; a
refused exec resent with its job id runs once; and the reconciler's lead (a session
advisory lock, which PostgreSQL releases with the session) is forgotten by the replica
whose session was cut, then held by one replica again, with every idle sandbox reaped once.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from tests.server import test_postgres_store
from tests.server.conftest import ServerProcess
from tests.server.test_two_replicas import agent_sandboxes, reconciler_actions, replicas, wait_until

postgres_server = test_postgres_store.postgres_server  # the fixtures: a PostgreSQL, a fresh database
database = test_postgres_store.database

SPEC = {"image": "host", "timeout": 60, "cpu": "1", "memory": "256Mi"}
ROUND = 'orchard_reconciler_actions_total{action="round"}'


# -- PostgreSQL, seen from the test ---------------------------------------------------------
def admin(database: str):
    import psycopg

    return psycopg.connect(database, autocommit=True)


def application_name(server: ServerProcess) -> str:
    """What the store names its session (``orchard-serve:<pid>``), to tell replicas apart."""
    assert server.process is not None
    return f"orchard-serve:{server.process.pid}"


def cut_sessions(database: str, server: ServerProcess) -> int:
    """pg_terminate_backend of every session of this server; how many there were."""
    with admin(database) as db:
        rows = db.execute("SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "  # waits until it ended
                          "WHERE application_name = %s", (application_name(server),)).fetchall()
    return sum(1 for (ended,) in rows if ended)


def reconciler_lock_holders(database: str) -> list[str]:
    """application_name of each session holding the reconciler's lead (PostgreSQL's view)."""
    from orchard.server.postgres import lock_id

    key = lock_id("reconciler") % 2**64  # a bigint advisory key shows as classid (high) and objid (low)
    with admin(database) as db:
        rows = db.execute("SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                          "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s "
                          "AND l.objsubid = 1", (key >> 32, key & 0xFFFFFFFF)).fetchall()
    return [name for (name,) in rows]


def pg_ctl(database: str, *argv: str) -> None:
    """Stop or start the fixture's PostgreSQL (its socket directory and port are in the URL)."""
    query = parse_qs(urlparse(database).query)
    root, port = Path(query["host"][0]), query["port"][0]
    bindir = Path(sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))[-1]).parent
    options = ["-o", f"-k {root} -p {port} -c listen_addresses='' -c fsync=off"] if argv[0] == "start" else []
    done = test_postgres_store.as_postgres(str(bindir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "log"),
                                           "-w", *options, *argv)
    assert done.returncode == 0, done.stderr


# -- the server, seen from a client ------------------------------------------------------------
def assert_store_unavailable(answer: httpx.Response) -> None:
    """The service's error body for a store that cannot be reached: typed, retryable, 503."""
    assert answer.status_code == 503, (answer.status_code, answer.text)
    error = answer.json()["error"]
    assert error["type"] == "StoreUnavailable" and error["retryable"] is True, answer.text
    assert "PostgreSQL" in error["message"], answer.text


def log_entries(server: ServerProcess, message: str) -> list[dict]:
    entries = []
    for line in Path(server.log_path).read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("message") == message:
            entries.append(entry)
    return entries


def statuses_answered(server: ServerProcess) -> set[str]:
    """Every HTTP status the server answered (its request counter)."""
    text = server.http().get("/metrics").text
    return {line.split('status="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("orchard_requests_total{")}


def created(http: httpx.Client, sandbox_id: str, attempts: int = 1) -> str:
    """Create, resending the same id after a 503 (as the SDK does) up to ``attempts`` times."""
    for _ in range(attempts):
        answer = http.post("/sandboxes", json={**SPEC, "sandbox_id": sandbox_id})
        if answer.status_code != 503 or answer.json()["error"]["type"] != "StoreUnavailable":
            break
        assert_store_unavailable(answer)
        time.sleep(0.2)
    assert answer.status_code == 200 and answer.json()["status"] == "ready", answer.text
    return sandbox_id


def ran(http: httpx.Client, sandbox_id: str, command: str, job_id: Optional[str] = None) -> dict:
    body = {"command": command, "wait": True, **({"job_id": job_id} if job_id else {})}
    answer = http.post(f"/sandboxes/{sandbox_id}/exec", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


# -- the tests -----------------------------------------------------------------------------------
def test_terminated_sessions_answer_503_then_the_server_connects_again(server_factory, database):
    # no reconciler round in this test: the calls below are the first to find each cut
    server = server_factory(store=database, reconciler={"interval": 3600})
    pid = server.process.pid
    with server.http() as http:
        kept = [created(http, f"pg-cut-{index}") for index in range(2)]
        for sandbox_id in kept:
            job = ran(http, sandbox_id, f"echo {sandbox_id}", job_id=f"job-{sandbox_id}")
            assert job["stdout"] == f"{sandbox_id}\n"

        assert cut_sessions(database, server) >= 1
        assert_store_unavailable(http.get(f"/sandboxes/{kept[0]}"))  # the call that finds the cut
        assert http.get(f"/sandboxes/{kept[0]}").json()["status"] == "ready"  # the next one connects again

        # a write cut mid-call: the command ran, its result could not be stored; resent with
        # its job id, the agent answers the one run (the counter in the sandbox says 1)
        counter = "sleep 1.5; echo run >> /tmp/runs; wc -l < /tmp/runs"
        pending = httpx.Client(base_url=server.url, headers={"X-API-Key": "test-key-123"}, timeout=60)
        with pending:
            answers: list[httpx.Response] = []
            call = threading.Thread(target=lambda: answers.append(pending.post(
                f"/sandboxes/{kept[1]}/exec", json={"command": counter, "wait": True, "job_id": "job-counted"})))
            call.start()
            time.sleep(0.7)  # the server has read the sandbox and waits on the agent
            assert cut_sessions(database, server) >= 1
            call.join(30)
        assert_store_unavailable(answers[0])
        resent = ran(http, kept[1], counter, job_id="job-counted")
        assert resent["stdout"] == "1\n", resent  # ran once, whatever the resends
        assert http.get("/jobs/job-counted").json()["status"] == "succeeded"

        # everything acknowledged before the cuts is there and usable, and new work goes on
        listed = {s["sandbox_id"]: s["status"] for s in http.get("/sandboxes").json()["sandboxes"]}
        assert listed == {sandbox_id: "ready" for sandbox_id in kept}
        for sandbox_id in kept:
            assert http.get(f"/jobs/job-{sandbox_id}").json()["stdout"] == f"{sandbox_id}\n"
            assert ran(http, sandbox_id, "echo again")["stdout"] == "again\n"
        assert ran(http, created(http, "pg-cut-after"), "echo new")["stdout"] == "new\n"
    assert server.process.poll() is None and server.process.pid == pid  # never restarted
    assert "500" not in statuses_answered(server)
    lost = log_entries(server, "PostgreSQL store connection lost")
    assert len(lost) == 2 and all("AdminShutdown" in entry["error"] or "closed" in entry["error"] for entry in lost)


def session_pids(database: str, server: ServerProcess) -> list[int]:
    """The PostgreSQL backend processes serving this server's sessions."""
    with admin(database) as db:
        rows = db.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                          (application_name(server),)).fetchall()
    return [pid for (pid,) in rows]


def test_a_hung_postgresql_answers_503_in_bounded_time_then_the_server_connects_again(server_factory, database):
    """PostgreSQL stops answering without cutting anything (its backend process stopped: a
    hang, or a partition dropping packets). Store calls are synchronous, so the first call
    waited for ever and the whole server with it (even /health). Now the watchdog gives up
    the connection after store_call_timeout: that call is a 503 StoreUnavailable, the server
    answers again, and once PostgreSQL is back it connects again with nothing lost."""
    server = server_factory(store=database, store_call_timeout=1.5, reconciler={"interval": 3600})
    with server.http() as http:
        kept = created(http, "pg-hung")
        assert ran(http, kept, "echo before")["stdout"] == "before\n"
        stopped = session_pids(database, server)
        assert stopped
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            answer = http.get(f"/sandboxes/{kept}", timeout=30)
            waited = time.monotonic() - started
            assert_store_unavailable(answer)
            assert waited < 1.5 + 3, waited  # the timeout, and the watchdog's tick (0.375 s here)
            assert http.get("/health", timeout=5).status_code == 200  # the server is free again
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        wait_until(lambda: http.get(f"/sandboxes/{kept}").status_code == 200, 30, "the store to connect again")
        assert http.get(f"/sandboxes/{kept}").json()["status"] == "ready"
        assert ran(http, kept, "echo after")["stdout"] == "after\n"
    assert "500" not in statuses_answered(server)
    assert log_entries(server, "PostgreSQL store call timed out: cutting its connection")


def test_a_postgresql_restart_answers_503_throughout_and_nothing_is_lost(server_factory, database):
    server = server_factory(store=database, reconciler={"interval": 0.3, "lost_grace": 2.0})
    pid = server.process.pid
    with server.http() as http:
        kept = created(http, "pg-restart")
        assert ran(http, kept, "echo before", job_id="job-before")["stdout"] == "before\n"
        queued = http.post(f"/sandboxes/{kept}/exec", json={"command": "sleep 3; echo later", "job_id": "job-later"})
        assert queued.status_code == 200 and queued.json()["status"] == "queued", queued.text

        pg_ctl(database, "stop", "-m", "fast")  # every session ends, as in a restart
        try:
            calls: dict[str, Callable[[], httpx.Response]] = {
                "get": lambda: http.get(f"/sandboxes/{kept}"),
                "list": lambda: http.get("/sandboxes"),
                "exec": lambda: http.post(f"/sandboxes/{kept}/exec", json={"command": "true", "wait": True}),
                "job": lambda: http.get("/jobs/job-before"),
                "create": lambda: http.post("/sandboxes", json={**SPEC, "sandbox_id": "pg-refused"}),
                "delete": lambda: http.delete(f"/sandboxes/{kept}"),
                "heartbeat": lambda: http.post(f"/sandboxes/{kept}/heartbeat"),
            }
            deadline = time.monotonic() + 2.0  # several reconnection attempts fail meanwhile
            while time.monotonic() < deadline:
                for name, call in calls.items():
                    assert_store_unavailable(call())
                assert http.get("/health").status_code == 200  # the process is healthy: no restart wanted
                time.sleep(0.2)
        finally:
            pg_ctl(database, "start")

        wait_until(lambda: http.get(f"/sandboxes/{kept}").status_code == 200, 15, "the server to connect again")
        assert http.get(f"/sandboxes/{kept}").json()["status"] == "ready"
        assert http.get("/jobs/job-before").json()["stdout"] == "before\n"
        later = http.get("/jobs/job-later/wait", params={"timeout": 30}).json()
        assert later["status"] == "succeeded" and later["stdout"] == "later\n", later
        assert ran(http, kept, "echo after")["stdout"] == "after\n"
        listed = [s["sandbox_id"] for s in http.get("/sandboxes").json()["sandboxes"]]
        assert listed == [kept]  # the refused create left no record, the refused delete deleted nothing
        assert ran(http, created(http, "pg-restart-after"), "echo new")["stdout"] == "new\n"
        rounds = float(http.get("/metrics").text.split(ROUND)[1].split()[0])
        wait_until(lambda: float(http.get("/metrics").text.split(ROUND)[1].split()[0]) > rounds + 2, 15,
                   "the reconciler's rounds to go on")
    assert server.process.poll() is None and server.process.pid == pid
    assert "500" not in statuses_answered(server)
    assert sorted(agent_sandboxes(server)) == ["pg-restart", "pg-restart-after"]  # nothing deleted, nothing extra


def test_the_leader_whose_session_is_cut_stops_leading_and_one_replica_leads_again(server_factory, database):
    """The leader's session is cut again and again (every 0.4 s) while idle sandboxes are
    created and expire; then PostgreSQL itself restarts under both replicas. A replica that
    is cut says so (``lead lost``) and takes the lead again only as PostgreSQL's holder;
    every idle sandbox is reaped ("expired") exactly once, by whichever replica led then, and
    nothing is left on the agent. (A reaping in flight at the cut may be finished by the
    next leader too: the cut one then logs that it could not delete it, or that it was
    already deleted; only the replica that removed the record counts it expired.)"""
    first, second = replicas(server_factory, database, heartbeat_ttl=2.0)
    by_name = {application_name(first): first, application_name(second): second}
    wait_until(lambda: len(reconciler_lock_holders(database)) == 1, 30, "one replica to lead")
    cuts, stop = [], threading.Event()

    def cut_the_leader() -> None:
        while not stop.wait(0.4):
            holders = reconciler_lock_holders(database)
            if holders and cut_sessions(database, by_name[holders[0]]):
                cuts.append(by_name[holders[0]].url)

    cutter = threading.Thread(target=cut_the_leader)
    cutter.start()
    try:
        sandboxes = []
        for index in range(16):
            with (first if index % 2 == 0 else second).http() as http:
                sandboxes.append(created(http, f"pg-lead-{index:02d}", attempts=20))
        wait_until(lambda: len(agent_sandboxes(first)) <= 8, 30, "reaping to be under way")
    finally:
        stop.set()
        cutter.join(30)
    pg_ctl(database, "stop", "-m", "fast")
    time.sleep(1.0)
    pg_ctl(database, "start")
    wait_until(lambda: agent_sandboxes(first) == [], 60, "every idle sandbox to be reaped")
    wait_until(lambda: len(reconciler_lock_holders(database)) == 1, 30, "one replica to lead again")
    assert len(cuts) >= 2, cuts

    actions = reconciler_actions(first, second)
    expired = sorted(sandbox_id for _, action, sandbox_id in actions if action == "expired")
    assert expired == sorted(sandboxes), actions  # each once, by whichever replica led then
    allowed = {"expired", "could not delete expired sandbox", "expired sandbox was already deleted", "marked_lost",
               "abandoned_create_deleted"}
    assert {action for _, action, _ in actions} <= allowed, actions  # in-flight work at a cut; never an orphan
    for server in (first, second):  # taken, lost, taken, ...: a lead is never taken twice without a loss
        kinds = [entry["message"] for entry in lead_events(server)]
        assert all(a != b for a, b in zip(kinds, kinds[1:])), kinds
    lost = [entry for server in (first, second) for entry in lead_events(server) if entry["message"] == "lead lost"]
    assert len(lost) >= len(cuts), (cuts, lost)
    leader = by_name[reconciler_lock_holders(database)[0]]
    assert lead_events(leader)[-1]["message"] == "lead taken"  # the replica PostgreSQL says leads believes it
    other = second if leader is first else first
    assert not lead_events(other) or lead_events(other)[-1]["message"] == "lead lost"  # and the other does not
    for server in (first, second):
        assert server.process.poll() is None
        assert "500" not in statuses_answered(server)


def lead_events(server: ServerProcess) -> list[dict]:
    """The replica's "lead taken" and "lead lost" log lines, in order."""
    return sorted(log_entries(server, "lead taken") + log_entries(server, "lead lost"), key=lambda e: e["time"])


def test_the_store_forgets_what_a_cut_session_held(database):
    """The store alone: a cut session's lead and claims are forgotten (PostgreSQL let them
    go), another store takes them, and records written before the cut are read back."""
    from orchard.errors import StoreUnavailable
    from orchard.server.postgres import PostgresStore

    first, second = PostgresStore(database), PostgresStore(database)
    first.put_sandbox(test_postgres_store.record("kept"))
    assert first.lead("reconciler") and first.claim("sbx-1")
    assert not second.lead("reconciler") and not second.claim("sbx-1")
    terminate(database, first)
    assert not first.lead("reconciler")  # the check finds the cut: no session, no lead
    first.release("sbx-1")  # nothing to let go: it went with the session
    assert second.lead("reconciler") and second.claim("sbx-1")
    assert not first.lead("reconciler") and not first.claim("sbx-1")  # connected again, held by the other
    assert first.get_sandbox("kept").sandbox.sandbox_id == "kept"
    second.close()
    terminate(database, first)
    with pytest.raises(StoreUnavailable, match="PostgreSQL"):
        first.get_sandbox("kept")
    assert first.get_sandbox("kept") is not None and first.lead("reconciler")
    first.close()


def terminate(database: str, store) -> None:
    """End one store's session from the outside, and wait until it has ended."""
    with admin(database) as db:
        assert db.execute("SELECT pg_terminate_backend(%s, 10000)", (store.db.info.backend_pid,)).fetchone()[0]


def test_writes_refused_by_a_read_only_standby_are_a_503(database):
    """After a failover the address may reach a server that is still a read-only standby:
    its refusal of a write is passing, so it is the retryable 503 too, not a 500."""
    from orchard.errors import StoreUnavailable
    from orchard.server.postgres import PostgresStore

    store = PostgresStore(database)
    store.db.execute("SET default_transaction_read_only = on")  # what a standby answers writes with
    with pytest.raises(StoreUnavailable, match="read-only"):
        store.put_sandbox(test_postgres_store.record("refused"))
    assert store.get_sandbox("refused") is None  # reads go on
    store.close()


def test_the_watchdog_never_cuts_a_socket_that_took_over_its_calls_descriptor_number(database):
    """libpq closes a dropped connection's socket itself, inside the call, before the store
    hears of it; another thread's new socket may get that number at once. The watchdog must
    cut the call's connection, not whatever holds the number by then; and a call leaks no
    descriptor."""
    import socket

    from orchard.server.postgres import PostgresStore

    store = PostgresStore(database, call_timeout=0.2)
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    store.get_sandbox("none")  # whatever the first call opens for good
    before = fds()
    for _ in range(100):
        store.get_sandbox("none")
    # One per call would be 100. Counted over the whole test process, so a few descriptors that
    # other tests' background threads open or close meanwhile must not fail it (2 did, once).
    assert fds() - before < 10
    ours, peer = socket.socketpair()
    ours.settimeout(5)
    try:
        with store._session() as db:
            # what libpq's drop and another thread's socket() amount to: the call's number is another socket now
            os.dup2(ours.fileno(), db.pgconn.socket)
            time.sleep(1.0)  # past call_timeout: the watchdog fires
        peer.sendall(b"ping")
        assert ours.recv(4) == b"ping"  # not shut down
    finally:
        store.close()  # libpq says goodbye on the socketpair and closes its (dup2'd) number
        ours.close()
        peer.close()
