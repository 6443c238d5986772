"""The BAR+GRPO trainer: rollouts in sandboxes, balanced groups, the GRPO update.

Each step takes ``tasks_per_step`` tasks from the loader; for each, BAR draws rollouts from
the rollout engine (forks of the task's prepared state) stride by stride until a group of
G with a balanced share of successes can be chosen (``sampler: fixed`` keeps the first G
instead; ``sampler: dapo`` draws G per task and more tasks until enough groups hold both a
success and a failure, DAPO's dynamic sampling). Rollouts the environment broke (aborted, timed out) never enter a group while
valid ones can replace them; they are counted in the metrics. Group-relative advantages,
then ``inner_epochs`` passes of the GRPO loss over the step's samples in micro-batches
(normalized over the whole step, so accumulation is exact), truncated importance sampling
against the sampler's log-probs, optional KL to a frozen reference. The rollout policy gets
the new weights through a :class:`WeightSync`. Checkpoints hold the model, optimizer, RNGs,
band and loader state.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import random
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from orchard.rollout.engine import RolloutEngine
from orchard.rollout.policies.model_thread import on_model_thread
from orchard.rollout.sample import RolloutSample
from orchard.train.memory import memory_mb
from orchard.tasks import Task
from orchard.train.bar import AdaptiveBand, Selection, bar_sample
from orchard.train.grpo import BatchSize, group_advantages, grpo_loss
from orchard.train.rl_batch import token_batch, token_logprobs
from orchard.train.rl_config import RLConfig
from orchard.train.weight_sync import SharedModel, WeightSync


def aborted_causes(pool: Sequence[RolloutSample]) -> dict[str, Any]:
    """Why a step's rollouts were aborted (error type -> count) and one message of each type,
    so a step that lost rollouts says whether the sandbox was lost, the agent unreachable or
    the call timed out (nothing, when none was aborted)."""
    aborted = [s for s in pool if s.status.value == "aborted"]
    if not aborted:
        return {}
    causes: dict[str, int] = {}
    examples: dict[str, str] = {}
    for sample in aborted:
        kind = sample.error_type or "unknown"
        causes[kind] = causes.get(kind, 0) + 1
        examples.setdefault(kind, (sample.error or "")[:300])
    return {"sandbox_error_causes": causes, "sandbox_error_examples": examples}


class TaskLoader:
    """Tasks in a seeded order, reshuffled each epoch; its position goes into checkpoints."""

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        if not tasks:
            raise ValueError("no training tasks")
        self.tasks, self.seed = list(tasks), seed
        self.epoch = self.position = 0

    def _order(self) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1000 + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[Task]:
        taken: list[Task] = []
        while len(taken) < n:
            order = self._order()
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                continue
            taken.append(self.tasks[order[self.position]])
            self.position += 1
        return taken

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class RLTrainer:
    def __init__(self, model: Any, engine: RolloutEngine, tasks: Sequence[Task], config: RLConfig, pad_id: int = 0,
                 weight_sync: Optional[WeightSync] = None) -> None:
        self.model, self.engine, self.config, self.pad_id = model, engine, config, pad_id
        self.weight_sync = weight_sync or SharedModel()
        self.loader = TaskLoader(tasks, config.seed)
        self.band = AdaptiveBand(config.bar().band, config.bar()) if config.adaptive_band else None
        self.reference = copy.deepcopy(model).eval() if config.loss.kl_coef else None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / config.warmup_steps) if config.warmup_steps else 1.0)
        self.step = 0
        self.rollouts_spent = 0
        config.output_dir.mkdir(parents=True, exist_ok=True)

    # -- rollouts ----------------------------------------------------------------------
    async def _select(self, task: Task) -> Selection:
        generate = self.engine.generator(task)
        if self.config.sampler == "fixed":
            return await self._fixed(task)
        if self.band is not None:
            return await self.band.sample(task.task_id, generate)
        return await bar_sample(generate, self.config.bar())

    # -- one step ----------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """All steps taken, or the rollout budget spent."""
        budget = self.config.rollout_budget
        return self.step >= self.config.steps or bool(budget and self.rollouts_spent >= budget)

    async def train(self, steps: Optional[int] = None, progress: bool = False) -> list[dict]:
        """Train to ``config.steps`` or the rollout budget (or ``steps`` more); returns the step records."""
        from rich.progress import Progress

        target = self.config.steps if steps is None else min(self.config.steps, self.step + steps)
        records = []
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("rl", total=self.config.steps, completed=self.step)
            while self.step < target and not self.finished:
                records.append(await self.train_step())
                bar.update(task, completed=self.step)
                if self.config.save_every and self.step % self.config.save_every == 0:
                    self.save()
        if self.finished:
            self.save()
            self.plot()
        return records

    async def _dapo_groups(self) -> list[Selection]:
        """DAPO's dynamic sampling: G rollouts per task, groups without both a success and a
        failure dropped, more tasks drawn until ``tasks_per_step`` groups carry a signal (at
        most ``dapo_max_batches`` batches). Dropped groups are counted as spent."""
        spent: list[Selection] = []
        for _ in range(self.config.dapo_max_batches):
            tasks = self.loader.next(self.config.tasks_per_step)
            spent += await asyncio.gather(*(self._fixed(task) for task in tasks))
            if sum(group.informative for group in spent) >= self.config.tasks_per_step:
                break
        chosen = {id(group) for group in [g for g in spent if g.informative][:self.config.tasks_per_step]}
        for group in spent:
            if id(group) not in chosen:
                group.group = []  # drawn and paid for, not trained on
        return spent

    async def _fixed(self, task: Task) -> Selection:
        pool = await self.engine.generator(task)(self.config.group_size)
        return Selection(pool, len(pool), 1, None, self.config.bar().band, pool)

    async def train_step(self) -> dict:
        started = time.perf_counter()
        if self.config.sampler == "dapo":
            selections = await self._dapo_groups()
        else:
            tasks = self.loader.next(self.config.tasks_per_step)
            selections = list(await asyncio.gather(*(self._select(task) for task in tasks)))
        rollout_seconds = time.perf_counter() - started
        samples, advantages = self._training_samples(selections)
        began = time.perf_counter()
        stats = await on_model_thread(self._update, samples, advantages) if samples else {}
        if samples:
            await self.weight_sync.push(self.model, self.step + 1)
        self.step += 1
        self.rollouts_spent += sum(len(selection.pool) for selection in selections)
        record = self._record(selections, samples, stats, rollout_seconds, time.perf_counter() - began)
        with open(self.config.output_dir / "metrics.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")
        return record

    def _training_samples(self, selections: list[Selection]) -> tuple[list[RolloutSample], list[float]]:
        """Each group's samples with a reward, and their group-relative advantages."""
        width = self.config.group_size
        rewards = torch.full((len(selections), width), math.nan)
        for row, selection in enumerate(selections):
            for col, rollout in enumerate(selection.group[:width]):
                if rollout.valid:
                    rewards[row, col] = float(rollout.reward)  # type: ignore[arg-type]
        advantages = group_advantages(rewards, scale=self.config.scale_advantages)
        samples: list[RolloutSample] = []
        values: list[float] = []
        for row, selection in enumerate(selections):
            for col, rollout in enumerate(selection.group[:width]):
                if rollout.valid:
                    samples.append(rollout.payload)
                    values.append(float(advantages[row, col]))
        return samples, values

    def _update(self, samples: list[RolloutSample], advantages: list[float]) -> dict[str, float]:
        config = self.config
        size = config.micro_batch_size
        parts = [token_batch(samples[i:i + size], advantages[i:i + size], self.pad_id)
                 for i in range(0, len(samples), size)]
        whole = BatchSize(sequences=len(samples), tokens=sum(part.tokens for part in parts))
        device = next(self.model.parameters()).device
        with torch.no_grad():
            self.model.eval()
            old = [token_logprobs(self.model, part)[0] for part in parts] if config.inner_epochs > 1 else None
            refs = [token_logprobs(self.reference, part)[0] for part in parts] if self.reference is not None else None
        self.model.train()
        totals: dict[str, float] = {"loss": 0.0, "entropy": 0.0, "clip_low": 0.0, "clip_high": 0.0, "kl": 0.0,
                                    "grad_norm": 0.0}
        for _ in range(config.inner_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for index, part in enumerate(parts):
                logps, entropy = token_logprobs(self.model, part, with_entropy=True)
                old_logps = old[index] if old is not None else logps.detach()
                mask = part.mask.to(device)
                loss, stats = grpo_loss(logps, old_logps, part.advantages.to(device), mask, config.loss,
                                        ref_logps=refs[index] if refs is not None else None,
                                        rollout_logps=part.behaviour_logps.to(device), batch=whole)
                loss.backward()
                share = float(mask.sum()) / max(whole.tokens, 1)
                totals["loss"] += float(loss.detach()) / config.inner_epochs
                totals["entropy"] += float((entropy * mask).sum()) / max(whole.tokens, 1) / config.inner_epochs
                for key in ("clip_low", "clip_high", "kl"):
                    totals[key] += stats.get(key, 0.0) * share / config.inner_epochs
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
            totals["grad_norm"] += float(norm) / config.inner_epochs
            self.optimizer.step()
        totals["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.model.eval()
        return totals

    def _record(self, selections: list[Selection], samples: list[RolloutSample], stats: dict[str, float],
                rollout_seconds: float, train_seconds: float) -> dict:
        pool = [rollout.payload for selection in selections for rollout in selection.pool]
        valid = [s for s in pool if s.reward is not None]
        return {
            "step": self.step, "tasks": len(selections), "samples": len(samples),
            "reward": sum(s.reward for s in samples) / len(samples) if samples else None,
            "success_rate": sum(s.resolved for s in valid) / len(valid) if valid else None,
            "rollouts": len(pool), "rollouts_spent": self.rollouts_spent, "rollouts_per_task": len(pool) / max(len(selections), 1),
            "fallback_rate": sum(s.fallback is not None for s in selections) / max(len(selections), 1),
            "informative_groups": sum(s.informative for s in selections if s.group),
            "sandbox_errors": sum(s.status.value == "aborted" for s in pool),
            **aborted_causes(pool),
            "timed_out": sum(s.status.value == "timed_out" for s in pool),
            "rollout_seconds": round(rollout_seconds, 3), "train_seconds": round(train_seconds, 3), **stats,
            **memory_mb(),
        }

    # -- checkpoints -------------------------------------------------------------------
    def save(self) -> Path:
        path = self.config.output_dir / f"checkpoint-{self.step}"
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "rollouts_spent": self.rollouts_spent,
                    "scheduler": self.scheduler.state_dict(),
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                    "loader": self.loader.state_dict(), "band": self.band.state_dict() if self.band else None,
                    "policy": self.engine.policy.state_dict(), "attempts": self.engine.state_dict()},
                   path / "state.pt")
        return path

    def resume(self, path: Path) -> None:
        state = torch.load(Path(path) / "state.pt", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.rollouts_spent = state.get("rollouts_spent", 0)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.loader.load_state_dict(state["loader"])
        if self.band is not None and state["band"] is not None:
            self.band.load_state_dict(state["band"])
        if state.get("policy") is not None:
            self.engine.policy.load_state_dict(state["policy"])
        if state.get("attempts") is not None:  # checkpoints before keyed draws have none
            self.engine.load_state_dict(state["attempts"])

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = [json.loads(line) for line in (self.config.output_dir / "metrics.jsonl").read_text().splitlines()]
        panels = [("success_rate", "success rate"), ("reward", "mean reward"), ("rollouts_per_task", "rollouts / task"),
                  ("fallback_rate", "fallback rate"), ("kl", "KL"), ("entropy", "entropy")]
        fig, axes = plt.subplots(2, 3, figsize=(11, 5.5))
        for ax, (key, label) in zip(axes.flat, panels):
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points])
            ax.set_title(label)
            ax.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(self.config.output_dir / "training.png", dpi=100)
        plt.close(fig)
