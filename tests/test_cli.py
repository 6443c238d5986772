"""The ``orchard`` command line, run as a user runs it (real processes, real agent)."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest


def orchard(*args: str, env_state: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "ORCHARD_STATE_DIR": env_state}
    result = subprocess.run([sys.executable, "-m", "orchard.cli", *args], capture_output=True, text=True, env=env,
                            timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def state():
    """An agent of its own: the CLI starts it with its default settings, which must not become
    the settings other test modules' sandboxes get from the shared session agent."""
    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import stop_agent

    path = Path(f"/tmp/orchard-cli-{os.getpid()}")
    yield str(path)
    stop_agent(AgentSettings(state_dir=path))
    subprocess.run(["rm", "-rf", str(path)])


def test_sandbox_create_exec_ls_rm(state):
    sandbox_id = orchard("sandbox", "create", env_state=state).stdout.strip()
    assert sandbox_id.startswith("sbx-")
    assert orchard("sandbox", "exec", sandbox_id, "echo hello from $HOSTNAME", env_state=state).stdout.startswith("hello")
    failing = orchard("sandbox", "exec", sandbox_id, "exit 7", env_state=state, check=False)
    assert failing.returncode == 7
    listed = json.loads(orchard("sandbox", "ls", "--json", env_state=state).stdout)
    assert sandbox_id in {s["sandbox_id"] for s in listed}
    assert orchard("sandbox", "rm", sandbox_id, env_state=state).stdout.strip() == f"deleted {sandbox_id}"


def test_errors_are_one_clear_line_and_nonzero(state):
    result = orchard("sandbox", "exec", "no-such-sandbox", "true", env_state=state, check=False)
    assert result.returncode == 2
    assert "SandboxNotFound" in result.stderr and "Traceback" not in result.stderr
    bad = orchard("sandbox", "create", "--image", "/no/such/dir", env_state=state, check=False)
    assert bad.returncode == 2 and "ImageRejected" in bad.stderr


def test_agent_status(state):
    orchard("sandbox", "ls", env_state=state)
    agents = json.loads(orchard("agent", "status", "--json", env_state=state).stdout)
    mine = [info for info in agents if info["state_dir"] == str(state)]
    assert len(mine) == 1 and mine[0]["address"].startswith("unix://")


def test_bench_sandboxes_smoke(state, tmp_path):
    output = tmp_path / "bench.json"
    orchard("bench", "sandboxes", "-n", "20", "-m", "2", "-c", "8", "--latency-samples", "20",
            "--output", str(output), env_state=state)
    result = json.loads(output.read_text())
    assert result["succeeded"] == 20 and result["failures"] == []
    assert result["leftovers"]["sandboxes"] == 0 and result["leftovers"]["sandbox_dirs"] == 0
    assert result["leftovers"]["mounts"] == 0
    assert result["exec_idle_p50_ms"] > 0 and result["commands_per_second"] > 0 and result["commands_failed"] == 0


def test_bench_sandboxes_counts_only_commands_that_succeeded(state, tmp_path):
    output = tmp_path / "bench.json"
    run = orchard("bench", "sandboxes", "-n", "2", "-m", "3", "-c", "2", "--latency-samples", "0", "--command",
                  "false", "--output", str(output), env_state=state, check=False)
    assert run.returncode == 1 and "failure bench-" in run.stdout  # failures fail the run
    result = json.loads(output.read_text())
    assert result["commands_failed"] == 6 and result["commands_per_second"] == 0


def test_quickstart_runs_end_to_end(state):
    result = orchard("quickstart", "--copies", "1", env_state=state)
    assert "4 sandboxes, 3 passed, 1 failed" in result.stdout


def test_bench_files_smoke(state, tmp_path):
    output = tmp_path / "files.json"
    orchard("bench", "files", "--samples", "5", "--output", str(output), env_state=state)
    result = json.loads(output.read_text())
    assert set(result) == {"samples", "upload 1024 B", "download 1024 B", "list", "exec true"}
    assert all(value["p50_ms"] > 0 for key, value in result.items() if key != "samples")
