"""The plugin proves itself with Orchard's conformance kit against a real agent on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """`orchard agent serve` on TCP loopback with its own state directory and token."""
    state = Path(f"/tmp/orchard-remote-agent-{os.getpid()}")
    port, token = _free_port(), "remote-agent-test-token"
    env = {**os.environ, "ORCHARD_AGENT_TOKEN": token}
    log = open(tmp_path_factory.mktemp("agent") / "agent.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "orchard.cli", "agent", "serve", "--state-dir", str(state),
                                "--port", str(port)], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        process.kill()
        raise RuntimeError("agent did not start")
    yield {"url": url, "token": token}
    process.terminate()
    process.wait(20)
    shutil.rmtree(state, ignore_errors=True)


def test_backend_is_listed_with_its_distribution():
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "backends", "--json"], capture_output=True, text=True)
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["remote-agent"]["distribution"] == "orchard-remote-agent" and rows["remote-agent"]["available"]


def test_bad_config_names_the_key():
    from orchard.client.aio import load_backend

    from orchard.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="backend.settings.tokn: Extra inputs are not permitted"):
        load_backend("remote-agent", {"url": "http://127.0.0.1:1", "tokn": "x"})


def test_conformance_suite_passes(agent, tmp_path):
    config = tmp_path / "backends.json"
    config.write_text(json.dumps({"remote-agent": agent}))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "orchard.testing",  # the whole suite
         "--orchard-backend", "remote-agent", "--orchard-backend-config", str(config)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
    assert int(re.search(r"(\d+) passed", result.stdout).group(1)) >= 28  # the whole suite ran, not a part
