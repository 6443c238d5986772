"""Runs started from runs: what a chain of ``continue_rl`` runs has already used.

A continuation trains on RL tasks generated after every RL task of the runs before it, and
its model carries one more ``+rl``. Both facts come from the earlier run's report.json
(``rl_tasks_used``, ``rl_rounds``); a report written before those keys existed is read from
its config and stages, following its ``start_from`` back where they do not say. Anything
malformed is refused with the file it came from, never read as a default: a wrong count
would train on tasks again or overwrite another model's evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_CHAIN = 1000  # runs followed back through older reports before giving up (a loop of start_from)


class PipelineInputError(ValueError):
    """A run that cannot start from what it was given (the CLI reports it as a usage error)."""


def read_report(run_dir: Path, setting: str = "start_from") -> dict[str, Any]:
    """``run_dir``'s report.json, checked to be an object whose config is one."""
    path = Path(run_dir) / "report.json"
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise PipelineInputError(f"{setting}: {run_dir} has no report.json (not a finished run)") from None
    except (OSError, ValueError) as exc:
        raise PipelineInputError(f"{setting}: {path} cannot be read: {exc}") from None
    if not isinstance(report, dict) or not isinstance(report.get("config", {}), dict):
        raise PipelineInputError(f"{setting}: {path} is not a pipeline report (an object with a config object)")
    return report


def rl_tasks_used(run_dir: Path, report: dict[str, Any] | None = None, _depth: int = 0) -> int:
    """How many RL tasks of their own ``run_dir`` and the runs it continued trained on."""
    report = read_report(run_dir) if report is None else report
    if "rl_tasks_used" in report:
        return _count(report["rl_tasks_used"], "rl_tasks_used", run_dir, minimum=0)
    config = report.get("config", {})
    own = _count(config.get("rl_tasks", 0), "config.rl_tasks", run_dir, minimum=0)
    if not config.get("continue_rl"):
        return own
    skipped = dig(report, "stages", "rl tasks", "after_earlier_runs")
    if skipped is not None:  # its own tasks came after this many
        return own + _count(skipped, "stages.rl tasks.after_earlier_runs", run_dir, minimum=0)
    earlier = config.get("start_from")
    if not isinstance(earlier, str) or not earlier or _depth >= MAX_CHAIN:
        raise PipelineInputError(f"start_from: {run_dir} continued RL, and its report does not say which RL "
                                 "tasks the runs before it used")
    return own + rl_tasks_used(Path(earlier), None, _depth + 1)


def rl_rounds_of_run(run_dir: Path, report: dict[str, Any] | None = None) -> int:
    """Rounds of RL in ``run_dir``'s RL weights (1: RL from SFT weights)."""
    report = read_report(run_dir) if report is None else report
    if "rl_rounds" in report:
        return _count(report["rl_rounds"], "rl_rounds", run_dir, minimum=1)
    return 2 if report.get("config", {}).get("continue_rl") else 1  # before rl_rounds, chains were refused


def _count(value: Any, key: str, run_dir: Path, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PipelineInputError(f"start_from: {run_dir}/report.json: {key} must be a whole number of at least "
                                 f"{minimum}, not {value!r}")
    return value


def dig(report: Any, *keys: str) -> Any:
    """``report[k1][k2]...``, or None where a level is missing or not an object."""
    for key in keys:
        if not isinstance(report, dict):
            return None
        report = report.get(key)
    return report
