"""mini-swe-agent (installed from PyPI) runs on an Orchard sandbox: the real `mini` command with
its deterministic test model fixes a planted bug, and the task's tests pass afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchard.client import Client
from orchard.errors import SandboxNotFound

BUGGY = "def add(a, b):\n    return a - b\n"
TESTS = ("import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
         "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n\nunittest.main()\n")
# -B: no bytecode cache. The fix keeps calc.py's size, and a .pyc is trusted while the source's
# size and mtime in whole seconds match, so an edit within the second of the first run read stale
# code (CI saw it: mini submitted `a + b`, the tests still ran `a - b`).
RUN_TESTS = "python3 -B test_calc.py"


def step(thought: str, command: str) -> dict:
    """One deterministic model turn (minisweagent.models.test_models.make_output's shape)."""
    return {"role": "assistant", "content": f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```",
            "extra": {"actions": [{"command": command}], "cost": 0.0}}


@pytest.fixture
def client():
    with Client() as client:
        yield client


@pytest.fixture
def mini_env(tmp_path):
    """mini's own environment variables: no first-run wizard, no banner, config under tmp."""
    return {**os.environ, "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mswea")}


def test_mini_fixes_a_bug_in_an_orchard_sandbox(client, tmp_path, mini_env):
    with client.create("host") as sandbox:
        sandbox.exec("mkdir -p /tmp/repo", check=True)
        sandbox.upload("/tmp/repo/calc.py", BUGGY)
        sandbox.upload("/tmp/repo/test_calc.py", TESTS)
        assert sandbox.exec(RUN_TESTS, cwd="/tmp/repo").exit_code != 0  # the task starts failing
        config = {
            "environment": {"environment_class": "orchard.integrations.mini_swe_agent.OrchardEnvironment",
                            "sandbox_id": sandbox.id, "cwd": "/tmp/repo"},
            "model": {"model_class": "minisweagent.models.test_models.DeterministicModel",
                      "model_name": "deterministic", "outputs": [
                          step("run the tests", RUN_TESTS),
                          step("add subtracts; fix it", "sed -i 's/a - b/a + b/' calc.py && cat calc.py"),
                          step("check", RUN_TESTS),
                          step("done", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff --no-index "
                                       "/dev/null calc.py || true")]},
            "agent": {"step_limit": 10, "cost_limit": 0},
        }
        (tmp_path / "orchard.yaml").write_text(json.dumps(config))  # JSON is YAML
        trajectory = tmp_path / "trajectory.json"
        result = subprocess.run(
            [sys.executable, "-m", "minisweagent.run.mini", "-c", "mini.yaml", "-c", str(tmp_path / "orchard.yaml"),
             "-y", "--exit-immediately", "-t", "make test_calc.py pass", "-o", str(trajectory)],
            capture_output=True, text=True, timeout=300, env=mini_env, cwd=tmp_path, stdin=subprocess.DEVNULL)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        saved = json.loads(trajectory.read_text())
        assert saved["info"]["exit_status"] == "Submitted"
        assert "return a + b" in saved["info"]["submission"]
        observations = [m["content"] for m in saved["messages"] if m["role"] == "user"][1:]
        assert "\"returncode\": 1" in observations[0] and "AssertionError" in observations[0]  # it started failing
        # the task's tests pass afterwards, run independently of the harness
        after = sandbox.exec(RUN_TESTS, cwd="/tmp/repo")
        assert after.exit_code == 0, after.stdout + after.stderr


def test_environment_contract_timeouts_submit_and_cleanup():
    from minisweagent.exceptions import Submitted

    from orchard.integrations.mini_swe_agent import OrchardEnvironment

    env = OrchardEnvironment(image="host", timeout=5, env={"WHO": "mini"})
    sandbox_id = env.sandbox.id
    out = env.execute({"command": "echo $WHO; echo err >&2; pwd; exit 2"}, cwd="/tmp")
    assert out == {"output": "mini\nerr\n/tmp\n", "returncode": 2, "exception_info": ""}
    slow = env.execute({"command": "echo started; sleep 30"}, timeout=1)
    assert slow["returncode"] == -1 and "timed out after 1 seconds" in slow["exception_info"]
    assert slow["output"].startswith("started\n")
    with pytest.raises(Submitted) as submitted:
        env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the patch"})
    assert submitted.value.messages[0]["extra"]["submission"] == "the patch\n"
    assert env.get_template_vars()["sandbox_id"] == sandbox_id
    assert env.serialize()["info"]["config"]["environment_type"].endswith("OrchardEnvironment")
    env.cleanup()
    env.cleanup()  # idempotent
    with Client() as client, pytest.raises(SandboxNotFound):
        client.get(sandbox_id)


def test_bad_config_key_is_named():
    from pydantic import ValidationError

    from orchard.integrations.mini_swe_agent import OrchardEnvironment

    with pytest.raises(ValidationError, match="imgae"):
        OrchardEnvironment(imgae="host")
