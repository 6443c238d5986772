"""``orchard bench bar``: BAR against fixed-G sampling and DAPO dynamic sampling, simulated.

Prompts have success probabilities drawn once from a Beta distribution (on the logit
scale) and drifting upward as "training" goes on: success is rare early and common
late, which is where a static band struggles. Rewards are +1/-1; some rollouts time out
or abort. Every parameter is pinned below (and in docs/benchmarks.md); results are
averaged over seeds.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from orchard.train.bar import AdaptiveBand, Band, BARConfig, Outcome, Rollout, Selection, bar_sample


@dataclass(frozen=True)
class SimulationParams:
    steps: int = 40  # gradient steps of the simulated run
    prompts: int = 256  # prompt pool
    batch: int = 16  # informative groups wanted per step (prompts per step for fixed-G and BAR)
    group_size: int = 8
    max_rollouts: int = 32
    stride: int = 8
    rho_min: float = 0.25
    rho_max: float = 0.75
    difficulty_alpha: float = 1.2  # base success probability ~ Beta(alpha, beta) ...
    difficulty_beta: float = 4.0
    drift_start: float = -1.5  # ... shifted on the logit scale from drift_start at step 0 ...
    drift_end: float = 2.5  # ... to drift_end at the last step
    timeout_rate: float = 0.03
    abort_rate: float = 0.01
    dapo_max_prompt_factor: int = 4  # DAPO draws at most this many times `batch` prompts per step


METHODS = ("fixed_g", "dapo", "bar_static", "bar_adaptive")


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


class World:
    """The prompts of one seed and how their success rates drift."""

    def __init__(self, params: SimulationParams, seed: int) -> None:
        self.params = params
        self.rng = random.Random(seed)
        self.base = [_logit(self.rng.betavariate(params.difficulty_alpha, params.difficulty_beta))
                     for _ in range(params.prompts)]

    def success(self, prompt: int, step: int) -> float:
        p = self.params
        shift = p.drift_start + (p.drift_end - p.drift_start) * step / max(1, p.steps - 1)
        return 1 / (1 + math.exp(-(self.base[prompt] + shift)))

    def rollout(self, prompt: int, step: int) -> Rollout:
        u = self.rng.random()
        if u < self.params.abort_rate:
            return Rollout(None, Outcome.ABORTED)
        if u < self.params.abort_rate + self.params.timeout_rate:
            return Rollout(None, Outcome.TIMED_OUT)
        return Rollout(1.0 if self.rng.random() < self.success(prompt, step) else -1.0)


@dataclass
class GroupRecord:
    rollouts: int
    positives: int
    valid: int
    fallback: Optional[bool]

    @property
    def informative(self) -> bool:
        return 0 < self.positives < self.valid

    @property
    def balance(self) -> float:
        return abs(self.positives / self.valid - 0.5) if self.valid else 0.5


def _record(group: list[Rollout], spent: int, fallback: Optional[bool]) -> GroupRecord:
    return GroupRecord(spent, sum(r.positive for r in group), sum(r.valid for r in group), fallback)


def _fixed_g(world: World, step: int, prompts: list[int], params: SimulationParams) -> list[GroupRecord]:
    return [_record([world.rollout(q, step) for _ in range(params.group_size)], params.group_size, None)
            for q in prompts]


def _dapo(world: World, step: int, prompts: list[int], params: SimulationParams) -> list[GroupRecord]:
    """Dynamic sampling: drop all-success / all-failure groups, draw more prompts."""
    kept, spent_on_dropped = [], 0
    for _ in range(params.batch * params.dapo_max_prompt_factor):
        prompt = world.rng.randrange(params.prompts)
        record = _record([world.rollout(prompt, step) for _ in range(params.group_size)], params.group_size, None)
        if record.informative:
            kept.append(record)
            if len(kept) == params.batch:
                break
        else:
            spent_on_dropped += record.rollouts
    if kept:
        kept[0].rollouts += spent_on_dropped  # the cost of dropped groups is charged to the step
    return kept


def _bar(world: World, step: int, prompts: list[int], params: SimulationParams,
         adaptive: Optional[AdaptiveBand]) -> list[GroupRecord]:
    config = BARConfig(params.group_size, params.max_rollouts, params.stride, Band(params.rho_min, params.rho_max))
    records = []
    for prompt in prompts:
        async def generate(n: int, prompt: int = prompt) -> list[Rollout]:
            return [world.rollout(prompt, step) for _ in range(n)]

        if adaptive:
            selection: Selection = asyncio.run(adaptive.sample(str(prompt), generate))
        else:
            selection = asyncio.run(bar_sample(generate, config))
        records.append(_record(selection.group, selection.rollouts_spent, selection.fallback is not None))
    return records


def simulate(method: str, params: SimulationParams, seed: int) -> dict[str, Any]:
    world = World(params, seed)
    adaptive = None
    if method == "bar_adaptive":
        config = BARConfig(params.group_size, params.max_rollouts, params.stride, Band(params.rho_min, params.rho_max))
        adaptive = AdaptiveBand(config.band, config)
    runners: dict[str, Callable[[int, list[int]], list[GroupRecord]]] = {
        "fixed_g": lambda step, prompts: _fixed_g(world, step, prompts, params),
        "dapo": lambda step, prompts: _dapo(world, step, prompts, params),
        "bar_static": lambda step, prompts: _bar(world, step, prompts, params, None),
        "bar_adaptive": lambda step, prompts: _bar(world, step, prompts, params, adaptive),
    }
    groups: list[GroupRecord] = []
    per_step_fallback: list[float] = []
    for step in range(params.steps):
        prompts = [world.rng.randrange(params.prompts) for _ in range(params.batch)]
        step_groups = runners[method](step, prompts)
        groups += step_groups
        flags = [g.fallback for g in step_groups if g.fallback is not None]
        per_step_fallback.append(sum(flags) / len(flags) if flags else 0.0)
    informative = sum(g.informative for g in groups)
    rollouts = sum(g.rollouts for g in groups)
    fallbacks = [g.fallback for g in groups if g.fallback is not None]
    return {
        "rollouts_per_informative_group": rollouts / informative if informative else math.inf,
        "informative_share": informative / len(groups) if groups else 0.0,
        "fallback_rate": sum(fallbacks) / len(fallbacks) if fallbacks else None,
        "group_balance": statistics.fmean(g.balance for g in groups) if groups else 0.5,
        "rollouts_per_step": rollouts / params.steps,
        "fallback_by_step": per_step_fallback,
    }


def run(seeds: int = 5, params: SimulationParams = SimulationParams()) -> dict[str, Any]:
    per_seed = {m: [simulate(m, params, seed) for seed in range(seeds)] for m in METHODS}
    summary: dict[str, dict[str, Any]] = {}
    for method, results in per_seed.items():
        summary[method] = {}
        for key in ("rollouts_per_informative_group", "informative_share", "fallback_rate", "group_balance",
                    "rollouts_per_step"):
            values = [r[key] for r in results if r[key] is not None]
            summary[method][key] = ({"mean": statistics.fmean(values), "std": statistics.pstdev(values)}
                                    if values else None)
        summary[method]["fallback_by_step"] = [statistics.fmean(step) for step in
                                               zip(*(r["fallback_by_step"] for r in results))]
    mean = lambda m, k: summary[m][k]["mean"]  # noqa: E731
    ratios = {
        "bar_vs_dapo_rollouts_per_informative_group": mean("bar_static", "rollouts_per_informative_group")
        / mean("dapo", "rollouts_per_informative_group"),
        "adaptive_vs_static_fallback_rate": mean("bar_adaptive", "fallback_rate") / mean("bar_static", "fallback_rate"),
        "adaptive_minus_static_balance": mean("bar_adaptive", "group_balance") - mean("bar_static", "group_balance"),
    }
    targets = {
        "bar_rollouts_per_informative_group_at_most_0.6x_dapo": ratios["bar_vs_dapo_rollouts_per_informative_group"] <= 0.6,
        "adaptive_fallback_at_most_0.5x_static": ratios["adaptive_vs_static_fallback_rate"] <= 0.5,
        "adaptive_balance_no_worse_than_static": ratios["adaptive_minus_static_balance"] <= 1e-9,
    }
    return {"params": asdict(params), "seeds": seeds, "summary": summary, "ratios": ratios, "targets": targets}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    methods = list(result["summary"])
    values = [result["summary"][m]["rollouts_per_informative_group"]["mean"] for m in methods]
    errors = [result["summary"][m]["rollouts_per_informative_group"]["std"] for m in methods]
    left.bar(methods, values, yerr=errors, color=["#999", "#6a9fd8", "#e39b46", "#3a9d5d"])
    left.set_ylabel("rollouts per informative group")
    left.set_title(f"cost of a learning signal ({result['seeds']} seeds)")
    for method, color in (("bar_static", "#e39b46"), ("bar_adaptive", "#3a9d5d")):
        right.plot(result["summary"][method]["fallback_by_step"], label=method, color=color)
    right.set_xlabel("training step (success drifts from rare to common)")
    right.set_ylabel("fallback rate")
    right.set_title("how often the band could not be met")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
