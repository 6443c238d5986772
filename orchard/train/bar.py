"""BAR, Balanced Adaptive Rollout: assemble, per prompt and per step, a training group of
size G whose share of successes lies in a band, spending as few rollouts as possible.

As the original does it: rollouts are generated ``stride`` at a time (concurrently) up to
``max_rollouts``; after each stride we try to select G samples with the number of
positives ``n_pos`` in ``[ceil(rho_min G), floor(rho_max G)]``, preferring the ``n_pos``
closest to ``round((rho_min + rho_max) / 2 * G)`` and taking the best positives and
negatives; sampling stops as soon as a group is found. If the budget runs out, the band
is relaxed to [0, 1]; if even that fails (fewer than G valid samples), the group is the
best ordering of what exists: completed < truncated < timed out < aborted. Aborted,
timed-out and reward-less samples never count as positives or negatives.

Beyond the original, :class:`AdaptiveBand` plans each prompt from sliding windows of
recent success rates (per prompt, else global): a static band keeps hitting the fallback
when success is rare early in training and common late. Once the budget is spent it
widens the band only as far as the prompt can reach (never to groups without both a
success and a failure). While the budget lasts the static band rules, so groups are as
balanced as the static band's. Its state goes into the trainer's checkpoint.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Awaitable, Callable, Optional


class Outcome(IntEnum):
    """How a rollout ended; the order is the fallback's preference."""

    COMPLETED = 0
    TRUNCATED = 1
    TIMED_OUT = 2
    ABORTED = 3


@dataclass
class Rollout:
    reward: Optional[float]
    outcome: Outcome = Outcome.COMPLETED
    payload: Any = None

    @property
    def valid(self) -> bool:
        """Counts as a positive or a negative: it finished (or was truncated) with a reward."""
        return (self.outcome <= Outcome.TRUNCATED and self.reward is not None
                and not math.isnan(self.reward))

    @property
    def positive(self) -> bool:
        return self.valid and self.reward > 0  # type: ignore[operator]


@dataclass(frozen=True)
class Band:
    rho_min: float
    rho_max: float

    def __post_init__(self) -> None:
        if not 0 <= self.rho_min <= self.rho_max <= 1:
            raise ValueError(f"band must satisfy 0 <= rho_min <= rho_max <= 1, got [{self.rho_min}, {self.rho_max}]")

    def counts(self, group_size: int) -> tuple[int, int, int]:
        """(lowest, highest, preferred) number of positives in a group of ``group_size``."""
        low, high = math.ceil(self.rho_min * group_size - 1e-9), math.floor(self.rho_max * group_size + 1e-9)
        preferred = round((self.rho_min + self.rho_max) / 2 * group_size)
        return low, high, preferred


@dataclass
class BARConfig:
    group_size: int = field(default=8, metadata={"help": "G: samples in a training group"})
    max_rollouts: int = field(default=32, metadata={"help": "N_max: rollout budget per prompt and step"})
    stride: int = field(default=8, metadata={"help": "rollouts generated at a time (concurrently)"})
    band: Band = field(default_factory=lambda: Band(0.25, 0.75), metadata={"help": "target share of positives"})

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.stride < 1 or self.max_rollouts < self.group_size:
            raise ValueError("need group_size >= 1, stride >= 1 and max_rollouts >= group_size")


@dataclass
class Selection:
    """What BAR chose for one prompt, and what it cost."""

    group: list[Rollout]
    rollouts_spent: int
    stride_found: Optional[int]  # 1-based stride after which the band was met; None if it never was
    fallback: Optional[str]  # None, "relaxed" (band [0, 1]) or "ordering"
    band: Band
    pool: list[Rollout] = field(repr=False, default_factory=list)

    @property
    def positives(self) -> int:
        return sum(r.positive for r in self.group)

    @property
    def informative(self) -> bool:
        """Both a success and a failure: the group carries a learning signal."""
        return 0 < self.positives < sum(r.valid for r in self.group)


def _ranked(rollouts: list[Rollout]) -> list[Rollout]:
    """Best first: higher reward, then the better outcome (stable for equal ones)."""
    return sorted(rollouts, key=lambda r: (-(r.reward if r.valid else -math.inf), r.outcome))


def select_group(pool: list[Rollout], group_size: int, band: Band) -> Optional[list[Rollout]]:
    """G samples from ``pool`` with a number of positives inside ``band`` (the one nearest
    the band's middle), best positives and best negatives first; None if impossible."""
    positives = _ranked([r for r in pool if r.positive])
    negatives = _ranked([r for r in pool if r.valid and not r.positive])
    low, high, preferred = band.counts(group_size)
    feasible = [n for n in range(max(low, 0), min(high, group_size) + 1)
                if n <= len(positives) and group_size - n <= len(negatives)]
    if not feasible:
        return None
    n_pos = min(feasible, key=lambda n: (abs(n - preferred), n))
    return positives[:n_pos] + negatives[:group_size - n_pos]


def fallback_group(pool: list[Rollout], group_size: int) -> list[Rollout]:
    """The best ordering of what exists: valid samples first, then by outcome."""
    ordered = sorted(pool, key=lambda r: (r.outcome if r.valid else Outcome.ABORTED + 1, r.outcome,
                                          -(r.reward if r.valid else -math.inf)))
    return ordered[:group_size]


Generate = Callable[[int], Awaitable[list[Rollout]]]


async def bar_sample(generate: Generate, config: BARConfig, band: Optional[Band] = None,
                     last_resort: Optional[Band] = None) -> Selection:
    """Run BAR for one prompt: ``generate(n)`` returns n new rollouts (run them concurrently).

    ``last_resort`` (from :class:`AdaptiveBand`) is a wider band tried once the budget is
    spent, before the relaxed fallback."""
    band = band or config.band
    pool: list[Rollout] = []
    strides = math.ceil(config.max_rollouts / config.stride)
    for index in range(1, strides + 1):
        pool += await generate(min(config.stride, config.max_rollouts - len(pool)))
        if len(pool) < config.group_size:
            continue
        group = select_group(pool, config.group_size, band)
        if group is not None:
            return Selection(group, len(pool), index, None, band, pool)
    if last_resort is not None:
        group = select_group(pool, config.group_size, last_resort)
        if group is not None:
            return Selection(group, len(pool), None, None, last_resort, pool)
    group = select_group(pool, config.group_size, Band(0.0, 1.0))
    if group is not None:
        return Selection(group, len(pool), None, "relaxed", band, pool)
    return Selection(fallback_group(pool, config.group_size), len(pool), None, "ordering", band, pool)


class AdaptiveBand:
    """Per-prompt last-resort bands from recent success rates.

    Success rates p are remembered per prompt (the last ``prompt_window`` steps) and
    globally (the last ``global_window`` prompts). With estimate p, about
    ``reach * p * max_rollouts`` positives can be counted on; the last-resort band reaches
    down (or up) to that, never past 1/G and (G-1)/G, so a group always holds a success
    and a failure.
    """

    def __init__(self, base: Band, config: BARConfig, global_window: int = 64, prompt_window: int = 4,
                 reach: float = 0.5) -> None:
        self.base = base
        self.config = config
        self.reach = reach
        self.global_window = global_window
        self.prompt_window = prompt_window
        self.global_rates: deque[float] = deque(maxlen=global_window)
        self.prompt_rates: dict[str, deque[float]] = {}

    def estimate(self, prompt: str) -> Optional[float]:
        own = self.prompt_rates.get(prompt)
        if own:
            return sum(own) / len(own)
        if self.global_rates:
            return sum(self.global_rates) / len(self.global_rates)
        return None

    def band_for(self, prompt: str) -> Band:
        """The last-resort band for this prompt (the static band while nothing is known)."""
        p = self.estimate(prompt)
        if p is None:
            return self.base
        g, budget = self.config.group_size, self.config.max_rollouts
        reachable_pos = max(1, math.floor(self.reach * p * budget)) / g
        reachable_neg = max(1, math.floor(self.reach * (1 - p) * budget)) / g
        low = max(1 / g, min(self.base.rho_min, reachable_pos))
        high = min((g - 1) / g, max(self.base.rho_max, 1 - reachable_neg))
        return Band(min(low, self.base.rho_min), max(high, self.base.rho_max))

    async def sample(self, prompt: str, generate: Generate) -> Selection:
        """BAR for one prompt under this plan; the outcome updates the windows."""
        selection = await bar_sample(generate, self.config, self.base, self.band_for(prompt))
        self.observe(prompt, selection)
        return selection

    def observe(self, prompt: str, selection: Selection) -> None:
        valid = [r for r in selection.pool if r.valid]
        if not valid:
            return
        rate = sum(r.positive for r in valid) / len(valid)
        self.global_rates.append(rate)
        self.prompt_rates.setdefault(prompt, deque(maxlen=self.prompt_window)).append(rate)

    def state_dict(self) -> dict[str, Any]:
        return {"global_rates": list(self.global_rates),
                "prompt_rates": {k: list(v) for k, v in self.prompt_rates.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_rates = deque(state["global_rates"], maxlen=self.global_window)
        self.prompt_rates = {k: deque(v, maxlen=self.prompt_window) for k, v in state["prompt_rates"].items()}
