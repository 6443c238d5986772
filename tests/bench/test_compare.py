"""``orchard bench compare`` on a tiny workload: every target's figures and the ratios."""

from __future__ import annotations

import asyncio

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
