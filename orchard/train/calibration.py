"""Calibration of value estimates: Brier score, expected calibration error, and
temperature scaling fitted on forecasts that did not see the outcome (not circular).

The temperature is fitted on the forecasts of some tasks and scored on the others
(:func:`held_out_calibration`): scored on the forecasts it was fitted to, it would look
better than it is, since it is chosen to fit exactly those. A temperature that does not
lower the held-out Brier score is reported but not offered for use.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

_EPS = 1e-6


def _logit(p: float) -> float:
    p = min(max(p, _EPS), 1 - _EPS)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def brier(probabilities: Sequence[float], outcomes: Sequence[int]) -> float:
    _check(probabilities, outcomes)
    return sum((p - y) ** 2 for p, y in zip(probabilities, outcomes)) / len(outcomes)


def expected_calibration_error(probabilities: Sequence[float], outcomes: Sequence[int], bins: int = 10) -> float:
    """Mean |confidence - frequency| over equal-width bins, weighted by bin size."""
    _check(probabilities, outcomes)
    totals = [[0.0, 0.0, 0] for _ in range(bins)]
    for p, y in zip(probabilities, outcomes):
        bucket = totals[min(int(p * bins), bins - 1)]
        bucket[0] += p
        bucket[1] += y
        bucket[2] += 1
    return sum(abs(s - y) for s, y, n in totals if n) / len(outcomes)


def _check(probabilities: Sequence[float], outcomes: Sequence[int]) -> None:
    if len(probabilities) != len(outcomes) or not outcomes:
        raise ValueError("need as many probabilities as outcomes, at least one")
    if any(not 0 <= p <= 1 for p in probabilities):
        raise ValueError("probabilities must lie in [0, 1]")


@dataclass
class TemperatureScaling:
    """``p' = sigmoid(logit(p) / T)``: T > 1 softens over-confident estimates."""

    temperature: float = 1.0

    def apply(self, p: float) -> float:
        return _sigmoid(_logit(p) / self.temperature)

    def apply_all(self, probabilities: Sequence[float]) -> list[float]:
        return [self.apply(p) for p in probabilities]

    @classmethod
    def fit(cls, probabilities: Sequence[float], outcomes: Sequence[int], low: float = 0.05,
            high: float = 20.0, iterations: int = 80) -> "TemperatureScaling":
        """Minimize the negative log-likelihood over log T (golden-section search)."""
        _check(probabilities, outcomes)
        logits = [_logit(p) for p in probabilities]

        def nll(log_t: float) -> float:
            t = math.exp(log_t)
            total = 0.0
            for z, y in zip(logits, outcomes):
                q = min(max(_sigmoid(z / t), _EPS), 1 - _EPS)
                total -= y * math.log(q) + (1 - y) * math.log(1 - q)
            return total

        a, b = math.log(low), math.log(high)
        ratio = (math.sqrt(5) - 1) / 2
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        for _ in range(iterations):
            if nll(c) < nll(d):
                b, d = d, c
                c = b - ratio * (b - a)
            else:
                a, c = c, d
                d = a + ratio * (b - a)
        return cls(math.exp((a + b) / 2))


def split_tasks(task_ids: Iterable[str], held_out_fraction: float = 0.5) -> tuple[list[str], list[str]]:
    """Distinct task ids split into (fit, held out), by a hash of the id: every attempt at a
    task lands on one side (attempts at one task are alike, so splitting them would leak),
    and the split depends neither on the input order nor on a random seed. Each side gets
    at least one task when there are two."""
    if not 0 < held_out_fraction < 1:
        raise ValueError("held_out_fraction must lie strictly between 0 and 1")
    tasks = sorted(set(task_ids), key=lambda t: (hashlib.sha256(t.encode()).hexdigest(), t))
    if len(tasks) < 2:
        return tasks, []
    held = min(max(round(len(tasks) * held_out_fraction), 1), len(tasks) - 1)
    return sorted(tasks[held:]), sorted(tasks[:held])


def held_out_calibration(forecasts: Sequence[Sequence[float]], outcomes: Sequence[int], task_ids: Sequence[str],
                         held_out_fraction: float = 0.5) -> tuple[Optional[TemperatureScaling], dict]:
    """Fit a temperature on the outcome-blind forecasts ``V(0..T)`` of some tasks' trajectories
    and score it on the other tasks' (Brier and ECE before/after, held-out part only).

    ``forecasts[i]`` are trajectory i's values, ``outcomes[i]`` its outcome (every value of a
    trajectory is scored against it), ``task_ids[i]`` its task. Returns the scaling to apply,
    or None where there is no held-out evidence that it helps (fewer than two tasks, or a
    held-out Brier score that does not improve), and the report."""
    if not len(forecasts) == len(outcomes) == len(task_ids):
        raise ValueError("need one outcome and one task id per trajectory")
    fit_tasks, held_tasks = split_tasks(task_ids, held_out_fraction)
    if not held_tasks:
        return None, {"applied": False, "skipped": "a held-out split needs at least 2 tasks"}
    held = set(held_tasks)

    def points(side: bool) -> tuple[list[float], list[int]]:
        chosen = [(f, y) for f, y, t in zip(forecasts, outcomes, task_ids) if (t in held) == side]
        return [p for f, _ in chosen for p in f], [y for f, y in chosen for _ in f]

    fit_p, fit_y = points(False)
    held_p, held_y = points(True)
    if not fit_p or not held_p:
        return None, {"applied": False, "skipped": "no forecasts on one side of the split"}
    scaling = TemperatureScaling.fit(fit_p, fit_y)
    after = scaling.apply_all(held_p)
    report = {"temperature": scaling.temperature, "fit_tasks": len(fit_tasks), "held_out_tasks": len(held_tasks),
              "fit_points": len(fit_p), "held_out_points": len(held_p),
              "brier_before": brier(held_p, held_y), "brier_after": brier(after, held_y),
              "ece_before": expected_calibration_error(held_p, held_y),
              "ece_after": expected_calibration_error(after, held_y)}
    report["applied"] = report["brier_after"] < report["brier_before"]
    return (scaling if report["applied"] else None), report
