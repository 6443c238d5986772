"""``orchard bench bar``: ways of building GRPO groups, compared in a simulated training run.

What is simulated (every number is pinned in :class:`SimulationParams`):

* **Prompts.** Each prompt has a success logit ``z = shared + own``: ``own`` starts as
  N(logit_mean, logit_std) and ``shared`` (one number for all prompts, 0 at the start) is
  the ability that transfers. The training pool is difficulty-filtered as SWE tasks are:
  out of ``candidates`` prompts, those with 0 < successes < ``filter_rollouts`` in that
  many rollouts of the initial policy (not charged). The held-out set is filtered the same
  way and never trained on; its pass rate is exact (the mean success probability).
* **Learning.** After each step, the GRPO update of the groups that were chosen: rewards
  +1/-1, advantages (r - mean) / std per group (sample std, as ``group_advantages``),
  the policy gradient of a Bernoulli policy on its logit, averaged over all the step's
  samples (zero-advantage samples count in the mean, as in the trainer), plain SGD of
  ``step_size``. A prompt's own logit moves by its group's share; every prompt (held-out
  ones too) moves by ``transfer`` times the sum of those moves.
* **Rollouts.** Durations are log-normal (failures take longer), cut at ``timeout_s``
  (timed out: no reward, charged the timeout); ``abort_rate`` of them lose their sandbox
  part way (no reward). Rollouts run on ``sandboxes`` sandboxes in submission order, so
  wall-clock is simulated: a step lasts until its last needed rollout ends, plus
  ``train_s`` for the update (synchronous RL).

Methods: ``fixed_g`` (G rollouts per prompt, all kept); ``dapo`` as slime runs it
(over-sampling batches of ``dapo_over_sampling`` x batch prompts, G rollouts each, the
dynamic filter drops zero-std groups and submits another batch whenever fewer than the
batch remain, in-flight rollouts are aborted when the batch is full and charged for the
time they ran); ``prefilter`` (fixed G, skipping prompts whose last group had zero
variance, except with probability ``prefilter_explore``); ``downsample`` (N_max rollouts
at once, then BAR's choice of G: BAR with stride N_max); ``bar_sS`` (static BAR, stride S)
and ``bar_adaptive_sS`` (:class:`~orchard.train.bar.AdaptiveBand`, later strides S).
Every method does one update per step on ``batch`` groups (DAPO: up to ``batch``).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Coroutine, Optional

from orchard.train.bar import AdaptiveBand, Band, BARConfig, Outcome, Rollout, Selection, bar_sample


@dataclass(frozen=True)
class SimulationParams:
    steps: int = 60  # optimizer steps per run
    batch: int = 16  # groups per step (prompts per step for every method but DAPO)
    group_size: int = 8
    max_rollouts: int = 32  # N_max
    strides: tuple[int, ...] = (4, 8, 16)  # BAR's strides (N_max is `downsample`)
    rho_min: float = 0.25
    rho_max: float = 0.75
    candidates: int = 1024  # prompts before the difficulty filter
    held_out_candidates: int = 512
    filter_rollouts: int = 8  # keep a prompt if 0 < successes < this, in this many initial rollouts
    logit_mean: float = -1.0  # a prompt's initial own logit ~ N(logit_mean, logit_std)
    logit_std: float = 2.0
    step_size: float = 8.0  # SGD step on the logits of the mean-over-samples GRPO loss
    transfer: float = 0.01  # every prompt's logit moves by this share of the sum of trained prompts' moves
    sandboxes: int = 128
    success_median_s: float = 120.0  # log-normal durations
    failure_median_s: float = 240.0
    duration_sigma: float = 0.8
    timeout_s: float = 900.0
    abort_rate: float = 0.01
    train_s: float = 60.0  # one update, sandboxes idle
    dapo_over_sampling: int = 2  # slime's --over-sampling-batch-size, in batches
    dapo_max_batches: int = 8  # over-sampling batches per step before DAPO trains on what it has
    prefilter_explore: float = 0.25

    def methods(self) -> list[str]:
        return (["fixed_g", "dapo", "prefilter", "downsample"] + [f"bar_s{s}" for s in self.strides]
                + [f"bar_adaptive_s{s}" for s in self.strides])

    def bar(self, stride: int) -> BARConfig:
        return BARConfig(self.group_size, self.max_rollouts, stride, Band(self.rho_min, self.rho_max))


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


class World:
    """One seed's prompts, policy and rollouts."""

    def __init__(self, params: SimulationParams, seed: int) -> None:
        self.params = params
        setup = random.Random(seed)

        def filtered(n: int) -> list[float]:
            kept = []
            for _ in range(n):
                z = setup.gauss(params.logit_mean, params.logit_std)
                wins = sum(setup.random() < _sigmoid(z) for _ in range(params.filter_rollouts))
                if 0 < wins < params.filter_rollouts:
                    kept.append(z)
            return kept

        self.own = filtered(params.candidates)
        self.held_out = filtered(params.held_out_candidates)
        self.shared = 0.0
        self.rng = random.Random(seed * 7919 + 1)

    def success(self, prompt: int) -> float:
        return _sigmoid(self.shared + self.own[prompt])

    def held_out_pass_rate(self) -> float:
        return statistics.fmean(_sigmoid(self.shared + z) for z in self.held_out)

    def rollout(self, prompt: int) -> tuple[Rollout, float]:
        """A rollout and the sandbox-seconds it takes."""
        p, rng = self.params, self.rng
        success = rng.random() < self.success(prompt)
        median = p.success_median_s if success else p.failure_median_s
        duration = median * math.exp(rng.gauss(0.0, p.duration_sigma))
        if rng.random() < p.abort_rate:
            return Rollout(None, Outcome.ABORTED, prompt), duration * rng.random()
        if duration > p.timeout_s:
            return Rollout(None, Outcome.TIMED_OUT, prompt), p.timeout_s
        return Rollout(1.0 if success else -1.0, Outcome.COMPLETED, prompt), duration

    def update(self, groups: list[tuple[int, list[Rollout]]]) -> tuple[int, int]:
        """The GRPO step on these groups; returns (samples, zero-advantage samples)."""
        samples = sum(r.valid for _, group in groups for r in group)
        zero = 0
        moves: list[tuple[int, float]] = []
        for prompt, group in groups:
            rewards = [float(r.reward) for r in group if r.valid]  # type: ignore[arg-type]
            std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
            if std == 0.0:
                zero += len(rewards)
                continue
            mean, p = statistics.fmean(rewards), self.success(prompt)
            gradient = sum((r - mean) / std * ((r > 0) - p) for r in rewards)
            moves.append((prompt, self.params.step_size * gradient / samples))
        for prompt, move in moves:
            self.own[prompt] += move
        self.shared += self.params.transfer * sum(move for _, move in moves)
        return samples, zero


class Loader:
    """The training prompts in a seeded order, reshuffled each epoch (as the trainer's)."""

    def __init__(self, count: int, seed: int) -> None:
        self.count, self.seed, self.epoch, self.order = count, seed, 0, deque[int]()
        self.consumed = 0

    def next(self, n: int) -> list[int]:
        taken = []
        for _ in range(n):
            if not self.order:
                order = list(range(self.count))
                random.Random(self.seed * 1000 + self.epoch).shuffle(order)
                self.order, self.epoch = deque(order), self.epoch + 1
            taken.append(self.order.popleft())
        self.consumed += n
        return taken


class _Job:
    __slots__ = ("prompt", "batch", "index", "start", "duration", "rollout", "cancelled", "finished")

    def __init__(self, prompt: int, batch: "_Batch", index: int) -> None:
        self.prompt, self.batch, self.index = prompt, batch, index
        self.start = self.duration = 0.0
        self.rollout: Optional[Rollout] = None
        self.cancelled = self.finished = False


@dataclass
class _Batch:
    left: int
    done: Callable[[list[Rollout]], None]
    results: list[Rollout] = field(default_factory=list)


class Cluster:
    """A pool of sandboxes and a simulated clock: rollouts start in submission order as
    sandboxes free up; a request's callback runs when all its rollouts have ended."""

    def __init__(self, world: World, slots: int) -> None:
        self.world, self.free = world, slots
        self.now = self.sandbox_seconds = 0.0
        self.started = 0
        self.waiting: deque[_Job] = deque()
        self.running: list[tuple[float, int, _Job]] = []
        self._seq = 0

    def request(self, prompt: int, n: int, done: Callable[[list[Rollout]], None]) -> None:
        if n == 0:
            done([])
            return
        batch = _Batch(n, done, [Rollout(None, Outcome.ABORTED)] * n)
        self.waiting.extend(_Job(prompt, batch, i) for i in range(n))
        self._dispatch()

    def _dispatch(self) -> None:
        while self.free and self.waiting:
            job = self.waiting.popleft()
            self.free -= 1
            self.started += 1
            job.start = self.now
            job.rollout, job.duration = self.world.rollout(job.prompt)
            self._seq += 1
            heapq.heappush(self.running, (self.now + job.duration, self._seq, job))

    def run(self) -> None:
        while self.running:
            end, _, job = heapq.heappop(self.running)
            self.now, self.free = end, self.free + 1
            self.sandbox_seconds += job.duration
            job.finished = True
            job.batch.results[job.index] = job.rollout  # type: ignore[assignment]
            job.batch.left -= 1
            if job.batch.left == 0:
                job.batch.done(job.batch.results)
            self._dispatch()

    def abort_all(self) -> None:
        """Stop everything: running rollouts are charged the time they ran, queued ones nothing."""
        for _, _, job in self.running:
            self.sandbox_seconds += self.now - job.start
            self.free += 1
        self.running.clear()
        self.waiting.clear()


class _Need:
    """What a sampler awaits: ``n`` more rollouts of its prompt."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __await__(self):  # type: ignore[no-untyped-def]
        return (yield self)


async def _generate(n: int) -> list[Rollout]:
    return await _Need(n)  # type: ignore[no-any-return]


def _drive(cluster: Cluster, prompt: int, sampler: Coroutine[Any, Any, Selection],
           finished: Callable[[Selection], None]) -> None:
    """Run a sampler coroutine (BAR's own code) on the simulated cluster."""
    def resume(rollouts: Optional[list[Rollout]]) -> None:
        try:
            need = sampler.send(rollouts)
        except StopIteration as stop:
            finished(stop.value)
            return
        cluster.request(prompt, need.n, resume)
    resume(None)


async def _fixed(group_size: int, band: Band) -> Selection:
    pool = await _generate(group_size)
    return Selection(pool, len(pool), 1, None, band, pool)


@dataclass
class StepRecord:
    rollouts: int
    sandbox_seconds: float
    wall_seconds: float
    prompts: int  # taken from the loader, used or not
    groups: int
    samples: int
    zero_advantage: int
    fallbacks: int
    adapted: int
    held_out: float


class Run:
    """One method on one seed."""

    def __init__(self, method: str, params: SimulationParams, seed: int) -> None:
        self.method, self.params = method, params
        self.world = World(params, seed)
        self.loader = Loader(len(self.world.own), seed)
        self.zero_variance: dict[int, bool] = {}  # prefilter's memory: did the prompt's last group have none?
        self.explore = random.Random(seed * 7919 + 2)
        self.adapted = 0  # prompts whose adaptive plan was not static BAR's
        self.adaptive = (AdaptiveBand(params.bar(self._stride()).band, params.bar(self._stride()))
                         if method.startswith("bar_adaptive") else None)

    def _stride(self) -> int:
        return int(self.method.rsplit("_s", 1)[1]) if self.method.startswith("bar") else self.params.max_rollouts

    def _sampler(self, prompt: int) -> Coroutine[Any, Any, Selection]:
        params, generate = self.params, _generate
        if self.method in ("fixed_g", "prefilter"):
            return _fixed(params.group_size, Band(params.rho_min, params.rho_max))
        if self.adaptive is not None:
            plan = self.adaptive.plan(str(prompt))
            self.adapted += (plan.band, plan.budget, plan.first_stride) != (self.adaptive.base, params.max_rollouts,
                                                                             self._stride())
            return self.adaptive.sample(str(prompt), generate)
        return bar_sample(generate, params.bar(self._stride()))

    def _prompts(self) -> list[int]:
        if self.method != "prefilter":
            return self.loader.next(self.params.batch)
        chosen: list[int] = []
        for _ in range(8 * self.params.batch):
            prompt = self.loader.next(1)[0]
            if not self.zero_variance.get(prompt) or self.explore.random() < self.params.prefilter_explore:
                chosen.append(prompt)
                if len(chosen) == self.params.batch:
                    break
        return chosen

    def _sample_prompts(self, cluster: Cluster) -> tuple[list[tuple[int, list[Rollout]]], int]:
        prompts = self._prompts()
        selections: dict[int, Selection] = {}
        for index, prompt in enumerate(prompts):
            _drive(cluster, prompt, self._sampler(prompt), lambda s, i=index: selections.__setitem__(i, s))
        cluster.run()
        groups = [(prompts[i], selections[i].group) for i in range(len(prompts))]
        for prompt, group in groups:
            self.zero_variance[prompt] = len({r.reward for r in group if r.valid}) < 2
        return groups, sum(s.fallback is not None for s in selections.values())

    def _sample_dapo(self, cluster: Cluster) -> list[tuple[int, list[Rollout]]]:
        params = self.params
        target, over = params.batch, params.dapo_over_sampling * params.batch
        kept: list[tuple[int, list[Rollout]]] = []
        state = {"remaining": 0, "batches": 0}

        def submit() -> None:
            if state["batches"] == params.dapo_max_batches:
                return
            state["batches"] += 1
            state["remaining"] += over
            for prompt in self.loader.next(over):
                cluster.request(prompt, params.group_size, lambda rollouts, q=prompt: finished(q, rollouts))

        def finished(prompt: int, rollouts: list[Rollout]) -> None:
            if len({r.reward for r in rollouts if r.valid}) < 2:  # the dynamic filter: zero std
                state["remaining"] -= 1
                if state["remaining"] < target:
                    submit()
                return
            kept.append((prompt, rollouts))
            if len(kept) == target:
                cluster.abort_all()

        submit()
        cluster.run()
        return kept

    def step(self) -> StepRecord:
        cluster = Cluster(self.world, self.params.sandboxes)
        consumed, adapted = self.loader.consumed, self.adapted
        if self.method == "dapo":
            groups, fallbacks = self._sample_dapo(cluster), 0
        else:
            groups, fallbacks = self._sample_prompts(cluster)
        samples, zero = self.world.update(groups)
        return StepRecord(cluster.started, cluster.sandbox_seconds, cluster.now + self.params.train_s,
                          self.loader.consumed - consumed, len(groups), samples, zero, fallbacks,
                          self.adapted - adapted, self.world.held_out_pass_rate())


def _at_budget(costs: list[float], values: list[float], budget: float) -> float:
    """The value after the last step whose cumulative cost is within the budget."""
    total, value = 0.0, values[0]
    for cost, after in zip(costs, values[1:]):
        total += cost
        if total > budget + 1e-9:
            break
        value = after
    return value


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def simulate(params: SimulationParams, seed: int) -> dict[str, Any]:
    """Every method on one seed; budgets are the least any method spent in ``steps`` steps."""
    runs: dict[str, tuple[float, list[StepRecord]]] = {}
    for method in params.methods():
        run = Run(method, params, seed)
        start = run.world.held_out_pass_rate()
        runs[method] = (start, [run.step() for _ in range(params.steps)])
    sandbox_budget = min(sum(r.sandbox_seconds for r in records) for _, records in runs.values())
    wall_budget = min(sum(r.wall_seconds for r in records) for _, records in runs.values())
    results = {}
    for method, (start, records) in runs.items():
        held = [start] + [r.held_out for r in records]
        samples = sum(r.samples for r in records)
        results[method] = {
            "held_out_at_equal_sandbox_time": _at_budget([r.sandbox_seconds for r in records], held, sandbox_budget),
            "held_out_at_equal_wall_clock": _at_budget([r.wall_seconds for r in records], held, wall_budget),
            "held_out_at_equal_steps": held[-1],
            "rollouts_per_step": statistics.fmean(r.rollouts for r in records),
            "rollouts_per_step_p95": _percentile([r.rollouts for r in records], 0.95),
            "rollouts_per_step_max": max(r.rollouts for r in records),
            "wall_clock_per_step_s": statistics.fmean(r.wall_seconds for r in records),
            "wall_clock_per_step_p95_s": _percentile([r.wall_seconds for r in records], 0.95),
            "wall_clock_per_step_max_s": max(r.wall_seconds for r in records),
            "sandbox_hours": sum(r.sandbox_seconds for r in records) / 3600,
            "prompts_per_step": statistics.fmean(r.prompts for r in records),
            "zero_advantage_share": sum(r.zero_advantage for r in records) / samples if samples else 0.0,
            "groups_per_step": statistics.fmean(r.groups for r in records),
            "fallback_rate": (sum(r.fallbacks for r in records) / sum(r.groups for r in records)
                              if method.startswith(("bar", "downsample")) else None),
            "adapted_share": (sum(r.adapted for r in records) / sum(r.groups for r in records)
                              if method.startswith("bar_adaptive") else None),
            "curve": {"start": start, "held_out": [r.held_out for r in records],
                      "sandbox_seconds": [r.sandbox_seconds for r in records],
                      "wall_seconds": [r.wall_seconds for r in records]},
        }
    return {"seed": seed, "held_out_start": runs[params.methods()[0]][0], "sandbox_budget_hours": sandbox_budget / 3600,
            "wall_budget_hours": wall_budget / 3600, "methods": results}


METRICS = ("held_out_at_equal_sandbox_time", "held_out_at_equal_wall_clock", "held_out_at_equal_steps",
           "rollouts_per_step", "rollouts_per_step_p95", "rollouts_per_step_max", "wall_clock_per_step_s",
           "wall_clock_per_step_p95_s", "wall_clock_per_step_max_s", "sandbox_hours", "prompts_per_step",
           "zero_advantage_share", "groups_per_step", "fallback_rate", "adapted_share")


def run(seeds: int = 5, params: SimulationParams = SimulationParams()) -> dict[str, Any]:
    per_seed = [simulate(params, seed) for seed in range(seeds)]
    summary: dict[str, dict[str, Any]] = {}
    for method in params.methods():
        summary[method] = {}
        for key in METRICS:
            values = [s["methods"][method][key] for s in per_seed if s["methods"][method][key] is not None]
            summary[method][key] = ({"mean": statistics.fmean(values), "std": statistics.pstdev(values)}
                                    if values else None)
    winners = {key: max(summary, key=lambda m: summary[m][key]["mean"])
               for key in ("held_out_at_equal_sandbox_time", "held_out_at_equal_wall_clock", "held_out_at_equal_steps")}
    winners.update({key: min(summary, key=lambda m: summary[m][key]["mean"])
                    for key in ("wall_clock_per_step_p95_s", "zero_advantage_share", "prompts_per_step")})
    paired: dict[str, dict[str, Any]] = {}  # adaptive minus static BAR, seed by seed
    for stride in params.strides:
        adaptive, static = f"bar_adaptive_s{stride}", f"bar_s{stride}"
        paired[f"{adaptive} - {static}"] = {}
        for key in ("held_out_at_equal_sandbox_time", "held_out_at_equal_wall_clock", "held_out_at_equal_steps",
                    "rollouts_per_step", "wall_clock_per_step_s"):
            deltas = [s["methods"][adaptive][key] - s["methods"][static][key] for s in per_seed]
            paired[f"{adaptive} - {static}"][key] = {"mean": statistics.fmean(deltas), "std": statistics.pstdev(deltas)}
    return {"params": asdict(params), "seeds": seeds, "paired": paired,
            "held_out_start": statistics.fmean(s["held_out_start"] for s in per_seed),
            "sandbox_budget_hours": statistics.fmean(s["sandbox_budget_hours"] for s in per_seed),
            "wall_budget_hours": statistics.fmean(s["wall_budget_hours"] for s in per_seed),
            "summary": summary, "winners": winners, "per_seed": per_seed}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = list(result["summary"])
    bases = list(dict.fromkeys(m.replace("adaptive_", "") for m in methods))  # static and adaptive share a color
    colors = plt.get_cmap("tab10")
    panels = ((axes[0], "sandbox_seconds", "sandbox-hours"), (axes[1], "wall_seconds", "wall-clock hours"))
    for ax, key, label in panels:
        for method in methods:
            curves = [s["methods"][method]["curve"] for s in result["per_seed"]]
            ends = [sum(c[key]) / 3600 for c in curves]
            grid = [i * min(ends) / 100 for i in range(101)]
            mean = [statistics.fmean(_at_budget(c[key], [c["start"]] + c["held_out"], x * 3600) for c in curves)
                    for x in grid]
            style = "--" if "adaptive" in method else "-"
            color = colors(bases.index(method.replace("adaptive_", "")) % 10)
            ax.plot(grid, [100 * v for v in mean], style, color=color, label=method)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out pass rate (%)")
        ax.set_title(f"held-out pass rate vs {label} ({result['seeds']} seeds, mean)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
