"""The plugin system: built-ins through the same hooks, entry points, limits, policy."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from orchard import hookimpl
from orchard.plugins import collect, get_plugin_manager, reset_plugin_manager, verify_image


def test_builtins_register_through_the_public_hooks():
    assert "local" in collect("orchard_register_backends")
    assert {"bwrap", "direct"} <= set(collect("orchard_register_runtimes"))


def test_every_hook_is_documented():
    from pathlib import Path

    from orchard import hookspecs

    pm = get_plugin_manager()
    names = [name for name in dir(hookspecs) if name.startswith("orchard_")]  # every hook there is, not a list
    assert len(names) >= 5
    plugin_docs = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
    for name in names:
        assert name in plugin_docs, f"{name} is missing from docs/plugins.md"
        spec = getattr(pm.hook, name).spec
        assert spec is not None and spec.function.__doc__ and len(spec.function.__doc__) > 40


def test_image_policy_any_refusal_wins():
    class Permissive:
        @hookimpl
        def orchard_verify_image(self, image, policy):
            return None

    class Strict:
        @hookimpl
        def orchard_verify_image(self, image, policy):
            return "unsigned" if image.startswith("docker://evil") else None

    pm = get_plugin_manager()
    strict, permissive = Strict(), Permissive()
    pm.register(strict)
    pm.register(permissive)  # registered last: called first by pluggy, must not override
    try:
        assert verify_image("docker://evil/x", {}) == "unsigned"
        assert verify_image("docker://good/x", {}) is None
    finally:
        pm.unregister(strict)
        pm.unregister(permissive)


def test_registering_without_a_name_is_an_error():
    class Nameless:
        pass

    class Plugin:
        @hookimpl
        def orchard_register_backends(self, register):
            register(Nameless)

    pm = get_plugin_manager()
    plugin = Plugin()
    pm.register(plugin)
    try:
        with pytest.raises(TypeError, match="static 'name'"):
            collect("orchard_register_backends")
    finally:
        pm.unregister(plugin)


def test_plugin_manager_is_built_on_demand_not_at_import():
    code = "import orchard, orchard.client, orchard.plugins as p; print(p._cached_manager.cache_info().currsize)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "0"


def test_entry_point_plugins_load_and_can_be_limited(tmp_path, monkeypatch):
    dist = tmp_path / "orchard_demo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: orchard-demo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[orchard]\ndemo = orchard_demo_plugin\n")
    (tmp_path / "orchard_demo_plugin.py").write_text(textwrap.dedent("""
        from orchard import hookimpl
        from orchard.backends.api import Backend

        class DemoBackend(Backend):
            name = "demo"
            async def create(self, spec): ...
            async def delete(self, sandbox_id): ...
            async def list(self): return []
            async def status(self, sandbox_id): ...
            async def endpoint(self, sandbox_id): ...

        @hookimpl
        def orchard_register_backends(register):
            register(DemoBackend)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for setting, expected in [("all", True), ("demo", True), ("none", False), ("other", False)]:
        monkeypatch.setenv("ORCHARD_PLUGINS", setting)
        reset_plugin_manager()
        assert ("demo" in collect("orchard_register_backends")) is expected, setting
        assert "local" in collect("orchard_register_backends")  # built-ins are never switched off
    monkeypatch.delenv("ORCHARD_PLUGINS")
    reset_plugin_manager()


def test_cli_lists_backends_with_distribution_and_availability():
    env = {**os.environ}
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "backends", "--json"], capture_output=True,
                            text=True, env=env)
    assert result.returncode == 0, result.stderr
    import json

    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["local"]["distribution"] == "orchard-rl" and rows["local"]["available"] is True
