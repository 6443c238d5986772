"""``orchard eval``'s arithmetic and reports: pass@k with its unbiased estimator, a table
per task, JSON and Markdown.

pass@k (Chen et al., 2021): with n attempts of which c resolved, the chance that k attempts
drawn without replacement hold at least one success is ``1 - C(n-c, k) / C(n, k)``;
averaged over tasks. Aborted attempts (the environment failed) are left out of n: they say
nothing about the policy (timed-out ones stay in, as failures). The overall pass rate comes
with a Wilson 95% interval, and so does ``pass_rate_all``, which counts every attempt, aborted
ones as failures: a run the environment mostly failed cannot look fine. More than
:data:`ABORTED_WARNING` of attempts aborted is a warning in the report, and a pass@k that some
task has too few valid attempts for is named in ``pass_at_k_left_out`` with those tasks.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from orchard.rollout.sample import RolloutSample, RolloutStatus

ABORTED_WARNING = 0.05  # a larger share of aborted attempts is warned about


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
    """Per-task results and the averages; a k larger than some task's valid attempts is left
    out of ``pass_at_k`` and said in ``pass_at_k_left_out`` (k -> {task: valid attempts})."""
    tasks: dict[str, TaskResult] = {}
    aborted: Counter = Counter()  # error type -> aborted attempts
    for sample in samples:
        result = tasks.setdefault(sample.task_id, TaskResult(sample.task_id))
        result.statuses[sample.status.value] = result.statuses.get(sample.status.value, 0) + 1
        if sample.status == RolloutStatus.ABORTED:
            aborted[sample.error_type or "unknown"] += 1
        else:
            result.attempts += 1
            result.resolved += sample.resolved
    attempts = sum(r.attempts for r in tasks.values())
    resolved = sum(r.resolved for r in tasks.values())
    everything = attempts + sum(aborted.values())
    usable = [k for k in ks if tasks and all(r.attempts >= k for r in tasks.values())]
    left_out = {f"pass@{k}": {r.task_id: r.attempts for r in sorted(tasks.values(), key=lambda r: r.task_id)
                              if r.attempts < k} for k in ks if k not in usable and tasks}
    statuses: dict[str, int] = defaultdict(int)
    for result in tasks.values():
        for status, count in result.statuses.items():
            statuses[status] += count
    warnings = []
    if everything and sum(aborted.values()) > ABORTED_WARNING * everything:
        causes = ", ".join(f"{kind} {count}" for kind, count in aborted.most_common())
        warnings.append(f"{sum(aborted.values())} of {everything} attempts ({sum(aborted.values()) / everything:.0%}) "
                        f"were aborted (the environment failed: {causes}); pass_rate leaves them out, "
                        "pass_rate_all counts them as failures")
    return {
        "tasks": len(tasks), "attempts": attempts, "resolved": resolved,
        "pass_rate": resolved / attempts if attempts else 0.0,
        "pass_rate_95": list(wilson_interval(resolved, attempts)),
        "attempts_all": everything, "aborted": sum(aborted.values()),
        "pass_rate_all": resolved / everything if everything else 0.0,
        "pass_rate_all_95": list(wilson_interval(resolved, everything)),
        "pass_at_k": {f"pass@{k}": sum(r.pass_at(k) for r in tasks.values()) / len(tasks) for k in usable},
        "pass_at_k_left_out": left_out,
        "statuses": dict(statuses), "warnings": warnings,
        "per_task": [{"task_id": r.task_id, "attempts": r.attempts, "resolved": r.resolved,
                      **{f"pass@{k}": r.pass_at(k) for k in usable}, "statuses": r.statuses}
                     for r in sorted(tasks.values(), key=lambda r: r.task_id)],
    }


def left_out_text(name: str, tasks: dict[str, int]) -> str:
    """Why ``name`` (pass@k) is not reported, naming the tasks that lack attempts (a few)."""
    k = name.removeprefix("pass@")
    shown = ", ".join(f"{task}: {n}" for task, n in list(tasks.items())[:5]) + (", ..." if len(tasks) > 5 else "")
    return f"not reported: {len(tasks)} task(s) have fewer than {k} valid attempts ({shown})"


def markdown(report: dict[str, Any], title: str = "Evaluation") -> str:
    low, high = report["pass_rate_95"]
    low_all, high_all = report["pass_rate_all_95"]
    lines = [f"# {title}", ""]
    lines += [f"- **warning**: {warning}" for warning in report["warnings"]]
    lines += [f"- tasks: {report['tasks']}, attempts: {report['attempts']} valid of {report['attempts_all']} "
              f"({report['aborted']} aborted), resolved: {report['resolved']}",
              f"- pass rate: {report['pass_rate']:.3f} (95% interval {low:.3f}-{high:.3f}; aborted attempts left out)",
              f"- pass rate of all attempts: {report['pass_rate_all']:.3f} (95% interval {low_all:.3f}-"
              f"{high_all:.3f}; aborted and timed out count as failures)"]
    lines += [f"- {name}: {value:.3f}" for name, value in report["pass_at_k"].items()]
    lines += [f"- {name}: {left_out_text(name, tasks)}" for name, tasks in report["pass_at_k_left_out"].items()]
    lines += [f"- statuses: {', '.join(f'{k} {v}' for k, v in sorted(report['statuses'].items()))}", ""]
    ks = list(report["pass_at_k"])
    lines += ["| " + " | ".join(["task", "attempts", "resolved", *ks, "aborted"]) + " |",
              "|" + "---|" * (4 + len(ks))]
    for row in report["per_task"]:
        cells = [row["task_id"], str(row["attempts"]), str(row["resolved"]), *(f"{row[k]:.2f}" for k in ks),
                 str(row["statuses"].get(RolloutStatus.ABORTED.value, 0))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], samples: Sequence[RolloutSample], out: Path, title: str) -> None:
    """``report.json``, ``report.md`` and ``samples.jsonl`` (conversations, no tokens) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report, title))
    with open(out / "samples.jsonl", "w") as handle:
        for sample in samples:
            handle.write(json.dumps(sample.to_dict(tokens=False)) + "\n")
