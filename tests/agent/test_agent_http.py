"""The agent's HTTP surface: auth, error bodies, wire compatibility with the original."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def agent(orchard_client):
    """(http client with the right key, http client with no key) on the local agent's socket."""
    endpoint = orchard_client._portal.call(orchard_client._inner.backend.endpoint("any"))
    transport = lambda: httpx.HTTPTransport(uds=endpoint.url.removeprefix("unix://"))  # noqa: E731
    good = httpx.Client(transport=transport(), base_url="http://agent", headers={"X-API-Key": endpoint.token})
    anonymous = httpx.Client(transport=transport(), base_url="http://agent")
    yield good, anonymous
    good.close()
    anonymous.close()


def test_root_and_health_are_open_everything_else_needs_the_key(agent):
    good, anonymous = agent
    assert anonymous.get("/").status_code == 200
    assert anonymous.get("/health").json() == {"status": "ok"}  # liveness only: no counts without a key
    for method, path in [("GET", "/sandboxes"), ("POST", "/sandboxes"), ("GET", "/resources"), ("GET", "/jobs/x")]:
        response = anonymous.request(method, path)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationFailed"
    wrong = anonymous.get("/sandboxes", headers={"X-API-Key": "wrong"})
    assert wrong.status_code == 401
    assert good.get("/sandboxes").status_code == 200


def test_validation_errors_name_the_field(agent):
    good, _ = agent
    sandbox = good.post("/sandboxes", json={}).json()
    try:
        response = good.post(f"/sandboxes/{sandbox['sandbox_id']}/exec", json={"command": "true", "timeout_seconds": -5})
        body = response.json()
        assert response.status_code == 422
        assert body["error"]["type"] == "InvalidRequest" and "timeout_seconds" in body["error"]["message"]
        assert body["detail"][0]["loc"] == ["body", "timeout_seconds"]
        bad_cpu = good.post("/sandboxes", json={"cpu": "lots"})
        assert bad_cpu.status_code == 422 and "cpu" in bad_cpu.json()["error"]["message"]
        bad_id = good.post("/sandboxes", json={"sandbox_id": "../etc"})
        assert bad_id.status_code == 422
        assert good.post(f"/sandboxes/{sandbox['sandbox_id']}/exec", content=b"{not json").status_code == 422
    finally:
        good.delete(f"/sandboxes/{sandbox['sandbox_id']}")


def test_original_clients_keep_working(agent):
    """Unknown fields are ignored, null means default, and wait:false returns a queued job."""
    good, _ = agent
    created = good.post("/sandboxes", json={"image": None, "block_network": None, "cpu": "500m",
                                            "memory": "1Gi", "timeout": 30, "future_field": {"x": 1}})
    assert created.status_code == 200, created.text
    sandbox = created.json()
    assert sandbox["status"] == "ready" and sandbox["ready"] is True and sandbox["block_network"] is True
    assert sandbox["cpu"] == "500m" and sandbox["memory"] == "1Gi"
    sid = sandbox["sandbox_id"]
    try:
        assert good.get(f"/sandboxes/{sid}/wait", params={"timeout": 1}).json()["ready"] is True
        queued = good.post(f"/sandboxes/{sid}/exec", json={"command": "echo hi", "timeout_seconds": None,
                                                            "cwd": None, "env": None, "unknown": 1}).json()
        assert queued["status"] in ("queued", "running") and set(queued) == {"job_id", "status"}
        job = good.get(f"/jobs/{queued['job_id']}/wait", params={"timeout": 10}).json()
        assert job["status"] == "succeeded" and job["stdout"] == "hi\n"
        for key in ("job_id", "sandbox_id", "command", "status", "stdout", "stderr", "exit_code", "created_at",
                    "started_at", "completed_at", "error", "error_type"):
            assert key in job
        running = good.post(f"/sandboxes/{sid}/exec", json={"command": "sleep 2", "wait": False}).json()
        still = good.get(f"/jobs/{running['job_id']}/wait", params={"timeout": 0.2}).json()
        assert still["status"] == "running"
        keyed = [good.post(f"/sandboxes/{sid}/exec", json={"command": "echo k >> k.txt", "wait": True},
                           headers={"Idempotency-Key": "same-key"}).json() for _ in range(2)]
        assert keyed[0]["job_id"] == keyed[1]["job_id"] == "same-key"
        assert good.post(f"/sandboxes/{sid}/exec", json={"command": "cat k.txt", "wait": True}).json()["stdout"] == "k\n"
        assert good.post(f"/sandboxes/{sid}/heartbeat").json()["sandbox_id"] == sid
        assert good.get("/jobs/nope").status_code == 404
        assert good.get("/resources").json()["sandboxes"]["ready"] >= 1
    finally:
        assert good.delete(f"/sandboxes/{sid}").json()["deleted"] is True
    gone = good.get(f"/sandboxes/{sid}")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "SandboxNotFound"
