"""Snapshots, forks and reset through `orchard serve` (real HTTP, real agent)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from orchard.agent.settings import AgentSettings
from orchard.backends.local.launcher import stop_agent
from tests.images import busybox_rootfs
from tests.server.conftest import ServerProcess


@pytest.fixture(scope="module")
def served():
    images = Path(f"/tmp/orchard-srv-snap-{os.getpid()}")
    images.mkdir(mode=0o755, exist_ok=True)
    image = str(busybox_rootfs(images / "root"))
    agent = AgentSettings(state_dir=images / "agent", image_dirs=[str(images)])
    server = ServerProcess(backend={"name": "local", "settings": {"agent": agent.model_dump(mode="json")}})
    yield server, image
    server.cleanup()
    stop_agent(agent)
    shutil.rmtree(images, ignore_errors=True)


def _error(response) -> str:
    return response.json()["error"]["type"]


def test_snapshot_fork_reset_over_http(served):
    server, image = served
    with server.http() as http:
        source = http.post("/sandboxes", json={"image": image}).json()["sandbox_id"]
        run = http.post(f"/sandboxes/{source}/exec", json={"command": "echo base > /workspace/f", "wait": True})
        assert run.json()["exit_code"] == 0
        snapshot = http.post(f"/sandboxes/{source}/snapshot", json={"snapshot_id": "snap-http"}).json()
        assert snapshot["snapshot_id"] == "snap-http" and snapshot["backend"] == "local"
        assert http.get("/snapshots/snap-http").json()["forks"] == 1  # the source goes on from it
        fork = http.post("/sandboxes", json={"image": image, "snapshot": "snap-http"}).json()
        assert fork["status"] == "ready"
        fid = fork["sandbox_id"]
        out = http.post(f"/sandboxes/{fid}/exec", json={"command": "cat /workspace/f; echo x > /workspace/f",
                                                         "wait": True}).json()
        assert out["stdout"] == "base\n"
        assert http.post(f"/sandboxes/{fid}/reset").json()["status"] == "ready"
        again = http.post(f"/sandboxes/{fid}/exec", json={"command": "cat /workspace/f", "wait": True}).json()
        assert again["stdout"] == "base\n"
        assert "snap-http" in [s["snapshot_id"] for s in http.get("/snapshots").json()["snapshots"]]
        assert http.delete("/snapshots/snap-http").json()["deleted"] is True
        assert _error(http.post("/sandboxes", json={"image": image, "snapshot": "snap-http"})) == "SnapshotNotFound"
        for sandbox_id in (fid, source):
            assert http.delete(f"/sandboxes/{sandbox_id}").status_code == 200


def test_snapshot_errors_are_4xx_naming_the_problem(served):
    server, image = served
    with server.http() as http:
        missing = http.post("/sandboxes/no-such/snapshot", json={})
        assert missing.status_code == 404 and _error(missing) == "SandboxNotFound"
        assert http.get("/snapshots/nope").status_code == 404
        assert http.delete("/snapshots/nope").status_code == 404
        bad_id = http.post("/sandboxes/x/snapshot", json={"snapshot_id": "../etc"})
        assert bad_id.status_code == 422 and "snapshot_id" in bad_id.text
        bad_fork = http.post("/sandboxes", json={"image": image, "snapshot": "../../x"})
        assert bad_fork.status_code == 422 and "snapshot" in bad_fork.text
        host = http.post("/sandboxes", json={"image": "host"}).json()["sandbox_id"]
        refused = http.post(f"/sandboxes/{host}/snapshot")
        assert refused.status_code == 422 and _error(refused) == "Unsupported"
        assert http.get(f"/sandboxes/{host}").json()["status"] == "ready", "a refused snapshot changes nothing"
        source = http.post("/sandboxes", json={"image": image}).json()["sandbox_id"]
        http.post(f"/sandboxes/{source}/snapshot", json={"snapshot_id": "snap-mismatch"})
        mismatch = http.post("/sandboxes", json={"image": "host", "snapshot": "snap-mismatch"})
        assert mismatch.status_code == 422 and "image" in mismatch.json()["error"]["message"]
        for sandbox_id in (host, source):
            http.delete(f"/sandboxes/{sandbox_id}")
        http.delete("/snapshots/snap-mismatch")


def test_snapshot_ids_in_urls_are_checked_like_ids_in_bodies(served):
    """DELETE /snapshots/snapx%23frag deleted snapx (the server forwarded '#frag' as a URL
    fragment); GET /snapshots/%2e%2e answered 500."""
    server, image = served
    with server.http() as http:
        source = http.post("/sandboxes", json={"image": image}).json()["sandbox_id"]
        assert http.post(f"/sandboxes/{source}/snapshot", json={"snapshot_id": "snapx"}).status_code == 200
        for method, path in [("DELETE", "/snapshots/snapx%23frag"), ("GET", "/snapshots/snapx%3Fz"),
                             ("GET", "/snapshots/%2e%2e"), ("DELETE", "/snapshots/%2e%2e")]:
            answer = http.request(method, path)
            assert answer.status_code == 422 and "snapshot_id" in answer.text, (method, path, answer.text)
        assert http.get("/snapshots/snapx").status_code == 200
        http.delete(f"/sandboxes/{source}")
        assert http.delete("/snapshots/snapx").status_code == 200
