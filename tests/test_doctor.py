"""``orchard doctor``: real probes of this machine, run as a user runs the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from orchard import hookimpl
from orchard.backends.api import Backend, BackendConfig
from orchard.backends.checks import Check
from orchard.plugins import get_plugin_manager


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchard.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=120, env=env or dict(os.environ))


def test_local_backend_passes_on_this_machine():
    result = doctor("--backend", "local", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"], result.stdout + result.stderr
    names = {check["name"] for check in report["checks"]}
    assert {"user namespaces (bwrap)", "cc", "docker:// images"} <= names
    assert any(name.startswith("cgroups (v") for name in names)


def test_missing_bubblewrap_fails_and_names_the_fix(tmp_path):
    """With nothing on PATH the probes fail for real: exit 1, each failure with its command."""
    result = doctor("--backend", "local", env={**os.environ, "PATH": str(tmp_path)})
    assert result.returncode == 1, result.stdout
    assert "MISSING  bubblewrap: bwrap not found on PATH" in result.stdout
    assert "fix: apt-get install bubblewrap" in result.stdout
    assert "backend local cannot run here" in result.stdout


def test_bad_settings_are_named(tmp_path):
    settings = tmp_path / "local.yaml"
    settings.write_text("agnet: {}\n")
    result = doctor("--backend", "local", "--settings", str(settings), "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 1 and not report["ok"]
    assert report["checks"][0] == {"name": "settings", "ok": False, "detail": "agnet: Extra inputs are not permitted",
                                   "fix": "correct the settings named above", "required": True}


def test_unknown_backend_is_a_usage_error():
    result = doctor("--backend", "no-such-backend")
    assert result.returncode == 2 and "unknown backend 'no-such-backend'; installed:" in result.stderr


class CheckedConfig(BackendConfig):
    socket: str = "/nonexistent.sock"


class CheckedBackend(Backend):
    """A plugin's backend that brings its own checks; core knows nothing of them."""

    name = "doctor-test"
    config_model = CheckedConfig

    @classmethod
    def doctor(cls, settings):
        path = Path(settings.get("socket", CheckedConfig().socket))
        return [Check("socket", path.exists(), str(path), "start the service", True),
                Check("extra tool", False, "not installed", "apt-get install extra", required=False)]

    async def create(self, spec): raise NotImplementedError
    async def delete(self, sandbox_id): raise NotImplementedError
    async def list(self): raise NotImplementedError
    async def status(self, sandbox_id): raise NotImplementedError
    async def endpoint(self, sandbox_id): raise NotImplementedError


class CheckedPlugin:
    @hookimpl
    def orchard_register_backends(self, register):
        register(CheckedBackend)


def test_a_plugin_backend_contributes_its_own_checks(tmp_path):
    from orchard.cli.main import cli

    plugin = CheckedPlugin()
    get_plugin_manager().register(plugin)
    try:
        failed = CliRunner().invoke(cli, ["doctor", "--backend", "doctor-test", "--json"])
        sock = tmp_path / "s.sock"
        sock.touch()
        settings = tmp_path / "s.yaml"
        settings.write_text(f"socket: {sock}\n")
        passed = CliRunner().invoke(cli, ["doctor", "--backend", "doctor-test", "--settings", str(settings)])
    finally:
        get_plugin_manager().unregister(plugin)
    assert failed.exit_code == 1
    assert json.loads(failed.output)["checks"][1] == {"name": "socket", "ok": False, "detail": "/nonexistent.sock",
                                                      "fix": "start the service", "required": True}
    assert passed.exit_code == 0, passed.output  # an optional check that fails does not stop the backend
    assert "optional extra tool: not installed" in passed.output and "can run on this machine" in passed.output
