"""The REST API of a real `orchard serve` process, over HTTP, as the original's clients use it."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

from tests.server.conftest import API_KEY


def test_full_life_cycle_over_http(server):
    with server.http() as http:
        created = http.post("/sandboxes", json={"image": "host", "timeout": 60, "cpu": "1", "memory": "1Gi"})
        assert created.status_code == 200, created.text
        sandbox = created.json()
        sid = sandbox["sandbox_id"]
        assert sandbox["status"] == "ready" and sandbox["backend"] == "local" and "orchard-server" not in sandbox["labels"]
        assert http.get(f"/sandboxes/{sid}/wait", params={"timeout": 5}).json()["ready"] is True

        job = http.post(f"/sandboxes/{sid}/exec", json={"command": "echo hi; exit 3", "wait": True}).json()
        assert (job["stdout"], job["exit_code"], job["status"], job["error_type"]) == ("hi\n", 3, "failed", None)

        queued = http.post(f"/sandboxes/{sid}/exec", json={"command": "sleep 0.5; echo later"}).json()
        assert set(queued) == {"job_id", "status"}
        polled = http.get(f"/jobs/{queued['job_id']}").json()
        assert polled["status"] in ("queued", "running")
        done = http.get(f"/jobs/{queued['job_id']}/wait", params={"timeout": 10}).json()
        assert done["status"] == "succeeded" and done["stdout"] == "later\n"
        assert http.get(f"/jobs/{queued['job_id']}").json()["stdout"] == "later\n"

        up = http.post(f"/sandboxes/{sid}/files", json={"path": "repo/f.txt", "content": base64.b64encode(b"a\nb\n").decode()})
        assert up.json() == {"success": True, "path": "/workspace/repo/f.txt", "size": 4}
        down = http.get(f"/sandboxes/{sid}/files", params={"path": "repo/f.txt"}).json()
        assert base64.b64decode(down["content"]) == b"a\nb\n"
        listing = http.get(f"/sandboxes/{sid}/files/list", params={"path": "repo"}).json()
        assert [f["name"] for f in listing["files"]] == ["f.txt"]
        patch = "--- a/repo/f.txt\n+++ b/repo/f.txt\n@@ -1,2 +1,2 @@\n a\n-b\n+c\n"
        applied = http.post(f"/sandboxes/{sid}/apply_patch", json={"patch": patch}).json()
        assert applied["success"], applied
        assert http.post(f"/sandboxes/{sid}/exec", json={"command": "cat repo/f.txt", "wait": True}).json()["stdout"] == "a\nc\n"

        assert http.post(f"/sandboxes/{sid}/heartbeat").json()["sandbox_id"] == sid
        assert sid in [s["sandbox_id"] for s in http.get("/sandboxes").json()["sandboxes"]]
        assert http.delete(f"/sandboxes/{sid}").json() == {"sandbox_id": sid, "deleted": True}
        gone = http.get(f"/sandboxes/{sid}")
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "SandboxNotFound"
        assert http.post(f"/sandboxes/{sid}/exec", json={"command": "true"}).status_code == 404


def test_auth(server):
    with server.http(api_key=None) as anonymous:
        assert anonymous.get("/").status_code == 200 and anonymous.get("/health").status_code == 200
        for method, path in [("GET", "/sandboxes"), ("POST", "/sandboxes"), ("GET", "/metrics"), ("GET", "/jobs/x")]:
            response = anonymous.request(method, path)
            assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationFailed"
        assert anonymous.get("/sandboxes", headers={"X-API-Key": "wrong"}).status_code == 401
    assert API_KEY not in server.log_path.read_text()


def test_bad_bodies_get_422_with_field_paths(server):
    with server.http() as http:
        bad = http.post("/sandboxes", json={"memory": "lots"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "memory"]
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        try:
            bad_exec = http.post(f"/sandboxes/{sid}/exec", json={"command": "true", "timeout_seconds": -1})
            assert bad_exec.status_code == 422 and "timeout_seconds" in bad_exec.json()["error"]["message"]
            assert bad_exec.json()["detail"][0]["loc"] == ["body", "timeout_seconds"]
            assert http.post(f"/sandboxes/{sid}/exec", json={}).status_code == 422
        finally:
            http.delete(f"/sandboxes/{sid}")


def test_same_idempotency_key_runs_once(server):
    with server.http() as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        try:
            for _ in range(3):
                job = http.post(f"/sandboxes/{sid}/exec", json={"command": "echo x >> runs; echo ok", "wait": True},
                                headers={"Idempotency-Key": "retry-me"}).json()
                assert job["job_id"] == "retry-me" and job["stdout"] == "ok\n"
            runs = http.post(f"/sandboxes/{sid}/exec", json={"command": "cat runs", "wait": True}).json()
            assert runs["stdout"] == "x\n"
            clash = http.post(f"/sandboxes/{sid}/exec", json={"command": "other", "job_id": "retry-me"})
            assert clash.status_code == 409
        finally:
            http.delete(f"/sandboxes/{sid}")


def test_sdk_and_streaming_through_the_server(server):
    with server.client() as client, client.create() as sandbox:
        assert sandbox.exec("echo via-server").stdout == "via-server\n"
        events = list(sandbox.exec_stream("echo one; echo two >&2"))
        assert events[-1]["type"] == "exit" and events[-1]["job"]["exit_code"] == 0
        payload = bytes(range(256)) * 20000
        sandbox.upload("big.bin", payload)
        assert sandbox.download("big.bin") == payload


def test_list_filters_resources_and_metrics(server):
    with server.http() as http:
        sid = http.post("/sandboxes", json={"labels": {"team": "rl"}}).json()["sandbox_id"]
        try:
            assert [s["sandbox_id"] for s in http.get("/sandboxes", params={"label": "team=rl"}).json()["sandboxes"]] == [sid]
            assert http.get("/sandboxes", params={"label": "team=none"}).json()["sandboxes"] == []
            resources = http.get("/resources").json()
            assert resources["backend"] == "local" and resources["sandboxes"]["ready"] >= 1
            metrics = http.get("/metrics").text
            assert 'orchard_sandboxes{status="ready"}' in metrics and "orchard_create_seconds_count" in metrics
            assert http.get("/", headers={"X-Request-ID": "abc"}).headers["x-request-id"] == "abc"
        finally:
            http.delete(f"/sandboxes/{sid}")
    lines = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    assert any(entry.get("message") == "request" and entry.get("request_id") for entry in lines)


def test_config_errors_name_the_key(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("backend:\n  name: local\n  settings:\n    agent:\n      bogus: 1\n")
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "backend.settings.agent.bogus" in result.stderr
    config.write_text("prot: 80\n")
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "prot" in result.stderr


def test_openapi_in_docs_is_current():
    from orchard.server.openapi import openapi_json

    checked_in = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
    assert checked_in.read_text() == openapi_json(), "refresh it: python -m orchard.server.openapi > docs/openapi.json"


def test_per_sandbox_agent_tokens_open_only_their_sandbox(server):
    import httpx as _httpx

    with server.http() as http:
        mine = http.post("/sandboxes", json={}).json()
        other = http.post("/sandboxes", json={}).json()
        try:
            assert mine["agent_url"].startswith("unix://") and mine["agent_token"].startswith("sbx.")
            shown = http.get(f"/sandboxes/{mine['sandbox_id']}").json()
            assert shown["agent_token"] is None and shown["agent_url"] is None  # never shown again
            listed = http.get("/sandboxes").json()["sandboxes"]
            assert all(s["agent_token"] is None for s in listed)
            transport = _httpx.HTTPTransport(uds=mine["agent_url"].removeprefix("unix://"))
            with _httpx.Client(transport=transport, base_url="http://agent",
                               headers={"X-API-Key": mine["agent_token"]}) as agent:
                job = agent.post(f"/sandboxes/{mine['sandbox_id']}/exec", json={"command": "echo direct", "wait": True})
                assert job.json()["stdout"] == "direct\n"
                queued = agent.post(f"/sandboxes/{mine['sandbox_id']}/exec", json={"command": "true"}).json()
                assert agent.get(f"/jobs/{queued['job_id']}/wait").status_code == 200
                other_job = http.post(f"/sandboxes/{other['sandbox_id']}/exec", json={"command": "true"}).json()
                for method, path in [("POST", f"/sandboxes/{other['sandbox_id']}/exec"), ("GET", "/sandboxes"),
                                     ("POST", "/sandboxes"), ("GET", f"/jobs/{other_job['job_id']}"),
                                     ("GET", "/resources")]:
                    response = agent.request(method, path, json={"command": "true"} if method == "POST" else None)
                    assert response.status_code == 401, (method, path)
        finally:
            http.delete(f"/sandboxes/{mine['sandbox_id']}")
            http.delete(f"/sandboxes/{other['sandbox_id']}")


def test_sdk_direct_path_bypasses_the_server_for_exec(server):
    from orchard.client import Client

    with Client(server.url, API_KEY, direct=True, heartbeat_interval=0.5) as client, client.create() as sandbox:
        log_before = server.log_path.read_text().count(f"/sandboxes/{sandbox.id}/exec")
        for _ in range(5):
            assert sandbox.exec("echo fast").stdout == "fast\n"
        assert server.log_path.read_text().count(f"/sandboxes/{sandbox.id}/exec") == log_before  # not via us
        import time as _time

        _time.sleep(1.2)
        assert f"/sandboxes/{sandbox.id}/heartbeat" in server.log_path.read_text()


def test_cli_against_the_server(server):
    env = {**__import__("os").environ, "ORCHARD_URL": server.url, "ORCHARD_API_KEY": API_KEY}

    def orchard(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchard.cli", *args], capture_output=True, text=True, env=env,
                              timeout=60)

    sid = orchard("sandbox", "create").stdout.strip()
    assert orchard("sandbox", "exec", sid, "echo from-cli").stdout == "from-cli\n"
    assert sid in orchard("sandbox", "ls", "--json").stdout
    assert orchard("sandbox", "rm", sid).returncode == 0
    assert orchard("sandbox", "exec", sid, "true").returncode == 2
