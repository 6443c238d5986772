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

Beyond the original, :class:`AdaptiveBand` plans each prompt *before* sampling it, from a
Beta posterior of its pass rate (its own recent pools, with the recent pools of all
prompts as the prior): the band is widened (never past one success and one failure) as
far as needed for the budget to reach it with the planned confidence, the first stride
is enlarged when one configured stride is unlikely to meet that band, and a prompt that
very likely cannot give a success and a failure within the budget gets a probe of G
valid rollouts instead of the whole budget. All of it acts from the first rollout, so groups
and costs differ from static BAR's. Its state goes into the trainer's checkpoint.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
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
                     first_stride: Optional[int] = None) -> Selection:
    """Run BAR for one prompt: ``generate(n)`` returns n new rollouts (run them concurrently).

    ``band`` replaces ``config.band``; ``first_stride`` (from :class:`AdaptiveBand`) sizes
    the first stride, the later ones are ``config.stride``."""
    band = band or config.band
    pool: list[Rollout] = []
    index = requested = 0
    while requested < config.max_rollouts:
        index += 1
        size = min(first_stride if index == 1 and first_stride else config.stride, config.max_rollouts - requested)
        requested += size
        pool += await generate(size)
        if len(pool) < config.group_size:
            continue
        group = select_group(pool, config.group_size, band)
        if group is not None:
            return Selection(group, len(pool), index, None, band, pool)
    return _budget_spent(pool, config.group_size, band)


def _budget_spent(pool: list[Rollout], group_size: int, band: Band) -> Selection:
    group = select_group(pool, group_size, Band(0.0, 1.0))
    if group is not None:
        return Selection(group, len(pool), None, "relaxed", band, pool)
    return Selection(fallback_group(pool, group_size), len(pool), None, "ordering", band, pool)


async def _probe(generate: Generate, config: BARConfig, band: Band) -> Selection:
    """G valid rollouts (broken ones replaced, within N_max) and one try at the band."""
    pool: list[Rollout] = []
    index = 0
    while (valid := sum(r.valid for r in pool)) < config.group_size and len(pool) < config.max_rollouts:
        index += 1
        pool += await generate(min(config.group_size - valid, config.max_rollouts - len(pool)))
    group = select_group(pool, config.group_size, band)
    if group is not None:
        return Selection(group, len(pool), index, None, band, pool)
    return _budget_spent(pool, config.group_size, band)


def _beta_binomial(n: int, a: float, b: float) -> list[float]:
    """P(k successes in n draws) for k = 0..n when the pass rate is Beta(a, b)."""
    first = math.exp(math.lgamma(a + b) + math.lgamma(n + b) - math.lgamma(b) - math.lgamma(n + a + b))
    pmf = [first]
    for k in range(n):
        pmf.append(pmf[-1] * (n - k) / (k + 1) * (k + a) / (n - k - 1 + b))
    return pmf


def _reach(pmf: list[float], group_size: int, low: int, high: int) -> float:
    """Chance that n = len(pmf) - 1 valid rollouts hold at least ``low`` successes and at
    least ``group_size - high`` failures: a group in the band can be chosen."""
    n = len(pmf) - 1
    if low > high or n < group_size:
        return 0.0
    return min(1.0, sum(pmf[max(low, 0):max(n - (group_size - high), -1) + 1]))


@dataclass(frozen=True)
class Plan:
    """How BAR samples one prompt: the band, the rollout budget and the first stride."""

    band: Band
    budget: int
    first_stride: int
    reach: Optional[float] = None  # predicted chance that the budget meets the band; None: nothing known
    probe: bool = False  # the prompt looked hopeless: a probe of G valid rollouts, not the budget


class AdaptiveBand:
    """Per-prompt plans from a Beta posterior of the prompt's pass rate.

    The posterior is Beta(prior_strength * m + s, prior_strength * (1 - m) + f): s and f
    are the successes and failures in the prompt's last ``prompt_window`` pools, m the
    pass rate over the last ``global_window`` pools of all prompts. From its predictive
    distribution (beta-binomial) the plan takes, before any rollout is drawn:

    * the band: the static band's counts, widened one count at a time (on the side that
      raises the chance most) while the budget meets it with a chance below
      ``confidence`` and widening still helps, never past one success and one failure;
    * the first stride: the fewest rollouts, not fewer than G or the configured stride,
      that meet that band in ``confidence`` of the cases in which the whole budget would
      (so a prompt known to be hard is drawn in fewer, larger strides); later strides are
      the configured stride;
    * the budget: a probe of G valid rollouts (broken ones are replaced, within N_max; it
      keeps the estimate fresh) instead of N_max for a prompt with pools of its own whose
      chance of even one success and one failure in N_max rollouts is below ``hopeless``.

    With nothing known (no pool yet) the plan is static BAR's.
    """

    def __init__(self, base: Band, config: BARConfig, global_window: int = 64, prompt_window: int = 4,
                 prior_strength: float = 2.0, confidence: float = 0.5, hopeless: float = 0.05) -> None:
        self.base = base
        self.config = config
        self.global_window = global_window
        self.prompt_window = prompt_window
        self.prior_strength = prior_strength
        self.confidence = confidence
        self.hopeless = hopeless
        self.global_counts: deque[tuple[float, float]] = deque(maxlen=global_window)
        self.prompt_counts: dict[str, deque[tuple[float, float]]] = {}

    def posterior(self, prompt: str) -> Optional[tuple[float, float]]:
        """(a, b) of the Beta posterior of the prompt's pass rate; None while nothing is known."""
        own = self.prompt_counts.get(prompt, ())
        if not own and not self.global_counts:
            return None
        seen = sum(n for _, n in self.global_counts)
        mean = sum(s for s, _ in self.global_counts) / seen if seen else 0.5
        mean = min(max(mean, 0.01), 0.99)
        successes = sum(s for s, _ in own)
        failures = sum(n - s for s, n in own)
        return self.prior_strength * mean + successes, self.prior_strength * (1 - mean) + failures

    def estimate(self, prompt: str) -> Optional[float]:
        """The posterior mean pass rate."""
        post = self.posterior(prompt)
        return None if post is None else post[0] / (post[0] + post[1])

    def plan(self, prompt: str) -> Plan:
        g, budget, stride = self.config.group_size, self.config.max_rollouts, self.config.stride
        post = self.posterior(prompt)
        if post is None:
            return Plan(self.base, budget, stride)
        a, b = post
        full = _beta_binomial(budget, a, b)
        if prompt in self.prompt_counts and g >= 2 and _reach(full, g, 1, g - 1) < self.hopeless:
            return Plan(Band(1 / g, (g - 1) / g), g, g, _reach(full, g, 1, g - 1), probe=True)
        low, high, _ = self.base.counts(g)
        reach = _reach(full, g, low, high)
        while reach < self.confidence:
            options = [(_reach(full, g, lo, hi), lo, hi) for lo, hi in ((low - 1, high), (low, high + 1))
                       if 1 <= lo <= hi <= g - 1]
            best = max(options, default=None)
            if best is None or best[0] <= reach + 1e-12:
                break  # widening further buys nothing
            reach, low, high = best
        band = self.base if (low, high) == self.base.counts(g)[:2] else Band(low / g, high / g)
        first = budget
        for n in range(max(g, stride), budget):
            if _reach(_beta_binomial(n, a, b), g, low, high) >= self.confidence * reach:
                first = n
                break
        return Plan(band, budget, first, reach)

    def band_for(self, prompt: str) -> Band:
        """The band this prompt would be sampled with now."""
        return self.plan(prompt).band

    async def sample(self, prompt: str, generate: Generate) -> Selection:
        """BAR for one prompt under its plan; the pool updates the estimates."""
        plan = self.plan(prompt)
        if plan.probe:
            selection = await _probe(generate, self.config, plan.band)
        else:
            config = replace(self.config, max_rollouts=plan.budget, band=plan.band)
            selection = await bar_sample(generate, config, plan.band, plan.first_stride)
        self.observe(prompt, selection)
        return selection

    def observe(self, prompt: str, selection: Selection) -> None:
        valid = [r for r in selection.pool if r.valid]
        if not valid:
            return
        counts = (float(sum(r.positive for r in valid)), float(len(valid)))
        self.global_counts.append(counts)
        self.prompt_counts.setdefault(prompt, deque(maxlen=self.prompt_window)).append(counts)

    def state_dict(self) -> dict[str, Any]:
        return {"global_counts": [list(c) for c in self.global_counts],
                "prompt_counts": {k: [list(c) for c in v] for k, v in self.prompt_counts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "global_rates" in state:  # checkpoints of the rate-only band: each rate as one sample
            state = {"global_counts": [(r, 1.0) for r in state["global_rates"]],
                     "prompt_counts": {k: [(r, 1.0) for r in v] for k, v in state["prompt_rates"].items()}}
        self.global_counts = deque((tuple(c) for c in state["global_counts"]), maxlen=self.global_window)
        self.prompt_counts = {k: deque((tuple(c) for c in v), maxlen=self.prompt_window)
                              for k, v in state["prompt_counts"].items()}
