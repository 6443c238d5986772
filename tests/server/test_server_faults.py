"""Faults, for real: a server killed mid-exec, a killed agent, lost heartbeats, a holder
killed behind the server's back, a backend that cannot list, orphans after a crash."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from tests.backends.test_local_isolation import holder_pid
from tests.images import free_port


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def test_server_killed_mid_exec_keeps_sandboxes_and_jobs(server_factory):
    server = server_factory(reconciler={"interval": 0.5})
    with server.http() as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        job_id = http.post(f"/sandboxes/{sid}/exec", json={"command": "sleep 2; echo survived"}).json()["job_id"]
    time.sleep(0.3)
    server.kill9()
    db = sqlite3.connect(str(server.root / "server.db"))
    server_id = db.execute("SELECT value FROM meta WHERE key='server_id'").fetchone()[0]
    db.close()
    # an orphan: the backend has a sandbox of this server that its records never got (crash in between)
    from orchard.client import Client

    with Client(backend_settings={"agent": {"state_dir": str(server.agent_state)}}) as direct:
        direct.create(sandbox_id="orphan-1", labels={"orchard-server": server_id})
        direct.create(sandbox_id="not-ours")  # no label: never touched
    server.start()
    with server.http() as http:
        job = http.get(f"/jobs/{job_id}/wait", params={"timeout": 20}).json()
        assert job["status"] == "succeeded" and job["stdout"] == "survived\n"
        assert http.get(f"/sandboxes/{sid}").json()["status"] == "ready"
        assert http.post(f"/sandboxes/{sid}/exec", json={"command": "echo still", "wait": True}).json()["stdout"] == "still\n"
    with Client(backend_settings={"agent": {"state_dir": str(server.agent_state)}}) as direct:
        wait_until(lambda: "orphan-1" not in {s.sandbox_id for s in direct.list()})
        assert "not-ours" in {s.sandbox_id for s in direct.list()}
        direct.delete("not-ours")


def test_killed_agent_means_lost_sandboxes_and_a_new_agent(server_factory):
    server = server_factory(reconciler={"interval": 0.5, "lost_grace": 0})
    with server.http() as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        job_id = http.post(f"/sandboxes/{sid}/exec", json={"command": "sleep 30"}).json()["job_id"]
        time.sleep(0.3)
        os.kill(server.agent_pid(), signal.SIGKILL)
        answer = http.post(f"/sandboxes/{sid}/exec", json={"command": "true", "wait": True})
        assert answer.status_code == 410, answer.text
        assert answer.json()["error"]["type"] == "SandboxLost" and "no longer has" in answer.json()["error"]["message"]
        job = http.get(f"/jobs/{job_id}").json()
        assert job["status"] == "failed" and job["error_type"] == "sandbox_lost"
        assert http.get(f"/sandboxes/{sid}").json()["status"] == "lost"
        fresh = http.post("/sandboxes", json={}).json()
        assert fresh["status"] == "ready"
        assert http.post(f"/sandboxes/{fresh['sandbox_id']}/exec", json={"command": "echo back", "wait": True}).json()["stdout"] == "back\n"


def test_sandboxes_without_heartbeats_are_reaped(server_factory):
    server = server_factory(reconciler={"interval": 0.5, "heartbeat_ttl": 2})
    with server.http() as http:
        quiet = http.post("/sandboxes", json={}).json()["sandbox_id"]
        kept = http.post("/sandboxes", json={}).json()["sandbox_id"]
        start = time.monotonic()
        while time.monotonic() - start < 4:
            assert http.post(f"/sandboxes/{kept}/heartbeat").status_code == 200
            time.sleep(0.5)
        assert http.get(f"/sandboxes/{quiet}").status_code == 404  # within TTL + one interval
        assert http.get(f"/sandboxes/{kept}").json()["status"] == "ready"
    from orchard.client import Client

    with Client(backend_settings={"agent": {"state_dir": str(server.agent_state)}}) as direct:
        assert quiet not in {s.sandbox_id for s in direct.list()}


def test_holder_killed_behind_the_servers_back_is_reported_lost(server_factory):
    server = server_factory(reconciler={"interval": 0.5, "lost_grace": 0})
    with server.client() as client:
        sandbox = client.create()
        os.kill(holder_pid(sandbox), signal.SIGKILL)
        with server.http() as http:
            status = wait_until(lambda: http.get(f"/sandboxes/{sandbox.id}").json()["status"] == "lost" and
                                http.get(f"/sandboxes/{sandbox.id}").json())
            assert "holder" in status["status_message"]
            answer = http.post(f"/sandboxes/{sandbox.id}/exec", json={"command": "true"})
            assert answer.status_code == 410 and answer.json()["error"]["type"] == "SandboxLost"
        sandbox.delete()


@pytest.fixture
def paused_agent():
    """An agent of our own on TCP (for the remote-agent backend), and a way to freeze it."""
    state = f"/tmp/orchard-frozen-{os.getpid()}"
    port = free_port()
    env = {**os.environ, "ORCHARD_AGENT_TOKEN": "frozen-token"}
    process = subprocess.Popen([sys.executable, "-m", "orchard.cli", "agent", "serve", "--state-dir", state,
                                "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _healthy(url))
    yield process, {"url": url, "token": "frozen-token"}
    process.send_signal(signal.SIGCONT)
    process.terminate()
    process.wait(20)
    subprocess.run(["rm", "-rf", state])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_failing_backend_list_deletes_nothing(server_factory, paused_agent):
    process, settings = paused_agent
    server = server_factory(backend={"name": "remote-agent", "settings": settings},
                            reconciler={"interval": 0.3, "list_timeout": 0.5, "lost_grace": 0})
    with server.http() as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        process.send_signal(signal.SIGSTOP)  # the backend can no longer answer
        time.sleep(2.5)  # several reconciler rounds
        metrics = http.get("/metrics").text
        assert 'orchard_reconciler_actions_total{action="list_failed"}' in metrics
        record = http.get(f"/sandboxes/{sid}").json()
        assert record["status"] == "ready"
        process.send_signal(signal.SIGCONT)
        job = http.post(f"/sandboxes/{sid}/exec", json={"command": "echo intact", "wait": True}).json()
        assert job["stdout"] == "intact\n"
        http.delete(f"/sandboxes/{sid}")


def test_a_queued_record_the_agent_never_took_ends_instead_of_staying_queued(server_factory):
    """An older server stored "queued" before the agent answered, so a refused request left a
    record that no agent would ever move on; it must end (failed), not read "queued" for ever."""
    from orchard.models import Job
    from orchard.server.store import SQLiteStore

    server = server_factory()
    with server.http() as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
    server.kill9()
    store = SQLiteStore(server.root / "server.db")
    store.put_job(Job(job_id="never-taken", sandbox_id=sid, command="true", status="queued", created_at=time.time()))
    store.close()
    server.start()
    with server.http() as http:
        job = http.get("/jobs/never-taken/wait", params={"timeout": 5}).json()
        assert job["status"] == "failed" and job["error_type"] == "internal" and "no record" in job["error"], job
        assert http.get("/jobs/never-taken").json()["status"] == "failed"
        assert http.get(f"/sandboxes/{sid}").json()["status"] == "ready"  # the sandbox itself is fine
        http.delete(f"/sandboxes/{sid}")


def test_a_bug_answers_a_typed_500_the_sdk_raises_as_internal_error(tmp_path, monkeypatch):
    """An exception nobody typed (a bug) answered Starlette's plain-text 'Internal Server
    Error', which no client can read as an error type; now the one error body, type
    InternalError, and the traceback stays in the server's log."""
    from fastapi.testclient import TestClient

    from orchard.errors import InternalError
    from orchard.client.http import ApiClient
    from orchard.server.app import create_app
    from orchard.server.config import ServerConfig
    from orchard.server.observability import Metrics
    from orchard.server.reconciler import Reconciler
    from orchard.server.service import ServerService

    config = ServerConfig(state=tmp_path / "server.db")
    service = ServerService(config, config.make_backend(), config.make_store(), Metrics())

    def broken(*args, **kwargs):
        raise KeyError("secret-internal-detail")

    monkeypatch.setattr(service.store, "list_sandboxes", broken)
    app = create_app(service, Reconciler(service, config.reconciler), None)
    with TestClient(app, raise_server_exceptions=False) as http:
        answer = http.get("/sandboxes")
    assert answer.status_code == 500
    assert answer.json()["error"]["type"] == "InternalError" and "KeyError" in answer.json()["error"]["message"]
    assert "secret-internal-detail" not in answer.text  # what the exception says stays in the log
    assert isinstance(ApiClient._error(500, answer.content), InternalError)
