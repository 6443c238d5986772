"""``orchard bench compare`` on a tiny workload: every target's figures and the ratios."""

from __future__ import annotations

import asyncio
import os

from orchard.bench.compare import run


def test_compare_reports_each_target_and_the_ratios():
    result = asyncio.run(run(["orchard", "swerex-local", "swerex-remote"], sandboxes=1, commands=4,
                             python_commands=1, chunk=2, image="host", spawner=True, state_dir=None))
    for name in ("orchard", "swerex-local", "swerex-remote"):
        entry = result[name]
        assert entry["true"]["n"] == 4 and entry["python"]["n"] == 1
        assert entry["true"]["p50_ms"] > 0 and entry["commands_per_s"] > 0
        assert set(entry["cpu_ms_per_command"]) == {"client", "server"}
    assert set(result["ratio_to_swerex_remote"]) == {"orchard", "swerex-local"}
    assert result["spawner"] is True


def test_the_other_swerex_ways_run_what_they_say_and_get_their_ratios():
    result = asyncio.run(run(["orchard", "swerex-remote", "swerex-remote-bash", "swerex-remote-session"], sandboxes=1,
                             commands=3, python_commands=1, chunk=2, image="host", spawner=True, state_dir=None))
    assert set(result["ratio_to_swerex_remote_bash"]) == {"orchard"}
    assert set(result["ratio_to_swerex_remote_session"]) == {"orchard"}
    assert result["swerex-remote-session"]["true"]["n"] == 3


def test_swerex_bash_runs_bash_and_swerex_shell_runs_sh():
    from orchard.bench.compare import SwerexTarget

    async def shell_of(way: str) -> str:
        target = SwerexTarget(f"swerex-remote-{way}", remote=True, way=way)
        await target.setup(1)
        try:
            response = await target.call(0, "echo ${BASH_VERSION:-none}")
            return getattr(response, "stdout", None) or response.output
        finally:
            await target.teardown()

    assert asyncio.run(shell_of("bash")).strip() != "none"
    sh_is_bash = os.path.basename(os.path.realpath("/bin/sh")) == "bash"  # Debian's is dash
    assert (asyncio.run(shell_of("shell")).strip() != "none") == sh_is_bash
    assert asyncio.run(shell_of("session")).strip() != "none"


def test_the_orchard_ways_in_process_direct_and_through_the_server():
    """``orchard-direct`` makes its sandboxes through the server and sends commands to the agent."""
    result = asyncio.run(run(["orchard", "orchard-direct", "orchard-server", "swerex-remote"], sandboxes=1, commands=3,
                             python_commands=1, chunk=2, image="host", spawner=True, state_dir=None))
    assert set(result["ratio_to_swerex_remote"]) == {"orchard", "orchard-direct", "orchard-server"}
    for name in ("orchard-direct", "orchard-server"):
        assert result[name]["true"]["n"] == 3 and result[name]["true"]["p50_ms"] > 0
