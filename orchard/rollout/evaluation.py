"""``orchard eval``'s arithmetic and reports: pass@k with its unbiased estimator, a table
per task, JSON and Markdown.

pass@k (Chen et al., 2021): with n attempts of which c resolved, the chance that k attempts
drawn without replacement hold at least one success is ``1 - C(n-c, k) / C(n, k)``;
averaged over tasks. Aborted attempts (the environment failed) are left out of n: they say
nothing about the policy. The overall pass rate comes with a Wilson 95% interval.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from orchard.rollout.sample import RolloutSample, RolloutStatus


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from ``n`` attempts with ``c`` successes."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1 (n={n}, c={c}, k={k})")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} attempts per task, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    if trials == 0:
        return (0.0, 1.0)
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class TaskResult:
    task_id: str
    attempts: int = 0  # not aborted
    resolved: int = 0
    statuses: dict[str, int] = field(default_factory=dict)

    def pass_at(self, k: int) -> float:
        return pass_at_k(self.attempts, self.resolved, k)


def summarize(samples: Iterable[RolloutSample], ks: Sequence[int] = (1,)) -> dict[str, Any]:
    """Per-task results and the averages; k values larger than a task's attempts are left out."""
    tasks: dict[str, TaskResult] = {}
    for sample in samples:
        result = tasks.setdefault(sample.task_id, TaskResult(sample.task_id))
        result.statuses[sample.status.value] = result.statuses.get(sample.status.value, 0) + 1
        if sample.status != RolloutStatus.ABORTED:
            result.attempts += 1
            result.resolved += sample.resolved
    attempts = sum(r.attempts for r in tasks.values())
    resolved = sum(r.resolved for r in tasks.values())
    usable = [k for k in ks if tasks and all(r.attempts >= k for r in tasks.values())]
    statuses: dict[str, int] = defaultdict(int)
    for result in tasks.values():
        for status, count in result.statuses.items():
            statuses[status] += count
    low, high = wilson_interval(resolved, attempts)
    return {
        "tasks": len(tasks), "attempts": attempts, "resolved": resolved,
        "pass_rate": resolved / attempts if attempts else 0.0, "pass_rate_95": [low, high],
        "pass_at_k": {f"pass@{k}": sum(r.pass_at(k) for r in tasks.values()) / len(tasks) for k in usable},
        "statuses": dict(statuses),
        "per_task": [{"task_id": r.task_id, "attempts": r.attempts, "resolved": r.resolved,
                      **{f"pass@{k}": r.pass_at(k) for k in usable}, "statuses": r.statuses}
                     for r in sorted(tasks.values(), key=lambda r: r.task_id)],
    }


def markdown(report: dict[str, Any], title: str = "Evaluation") -> str:
    low, high = report["pass_rate_95"]
    lines = [f"# {title}", "", f"- tasks: {report['tasks']}, attempts: {report['attempts']}, "
             f"resolved: {report['resolved']}",
             f"- pass rate: {report['pass_rate']:.3f} (95% interval {low:.3f}-{high:.3f})"]
    lines += [f"- {name}: {value:.3f}" for name, value in report["pass_at_k"].items()]
    lines += [f"- statuses: {', '.join(f'{k} {v}' for k, v in sorted(report['statuses'].items()))}", ""]
    ks = list(report["pass_at_k"])
    lines += ["| task | attempts | resolved | " + " | ".join(ks) + " |",
              "|---|---|---|" + "---|" * len(ks)]
    for row in report["per_task"]:
        lines.append(f"| {row['task_id']} | {row['attempts']} | {row['resolved']} | "
                     + " | ".join(f"{row[k]:.2f}" for k in ks) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], samples: Sequence[RolloutSample], out: Path, title: str) -> None:
    """``report.json``, ``report.md`` and ``samples.jsonl`` (conversations, no tokens) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report, title))
    with open(out / "samples.jsonl", "w") as handle:
        for sample in samples:
            handle.write(json.dumps(sample.to_dict(tokens=False)) + "\n")
