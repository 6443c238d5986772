"""Calibration of value estimates: Brier score, expected calibration error, and
temperature scaling fitted on forecasts that did not see the outcome (not circular)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

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


def calibration_report(forecasts: Sequence[float], outcomes: Sequence[int]) -> dict[str, float]:
    """Fit on forecasts (estimates made without the outcome) and report before/after."""
    scaling = TemperatureScaling.fit(forecasts, outcomes)
    after = scaling.apply_all(forecasts)
    return {"temperature": scaling.temperature, "brier_before": brier(forecasts, outcomes),
            "brier_after": brier(after, outcomes), "ece_before": expected_calibration_error(forecasts, outcomes),
            "ece_after": expected_calibration_error(after, outcomes)}
