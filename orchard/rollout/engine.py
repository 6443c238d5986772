"""Many rollouts at once against a bounded pool of sandboxes, with grading and metrics.

Trainers and ``orchard eval`` go through :class:`RolloutEngine`: it prepares each task once
(:class:`PreparedTask`), runs episodes in forks of it, grades what they submit, and keeps
at most ``max_concurrent`` rollout sandboxes alive (a rollout's grading sandbox is made
after its own is deleted, in the same slot). Whatever happens, every sandbox is deleted.
``group(task, k)`` is what BAR's ``generate`` callback needs.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Coroutine, Optional, TypeVar

from orchard.client.aio import AsyncClient
from orchard.errors import OrchardError
from orchard.rollout.environment import PreparedTask, delete_sandbox, finish
from orchard.rollout.grading import extract_diff, grade
from orchard.rollout.loop import RolloutConfig, run_episode
from orchard.rollout.policy import Policy
from orchard.rollout.sample import RolloutSample, RolloutStatus
from orchard.tasks import Task
from orchard.train.bar import Rollout

T = TypeVar("T")
GRADED = (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)  # BAR counts these; timed out and aborted never


@dataclass
class EngineConfig:
    """How many rollouts run at once and what each sandbox gets."""

    max_concurrent: int = field(default=32, metadata={"help": "rollout sandboxes alive at once (per backend)"})
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sandbox: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "create options of every sandbox: cpu, memory, disk, block_network, labels"})
    grade: bool = field(default=True, metadata={
        "help": "grade what rollouts submit (False: rewards stay None; for collection or overhead runs)"})
    grace_seconds: float = field(default=120.0, metadata={
        "help": "a straggler is cut off this long after its task's time limit (grading included)"})

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")


@dataclass
class EngineMetrics:
    rollouts: int = 0
    wall_seconds: float = 0.0
    policy_seconds: float = 0.0
    sandbox_seconds: float = 0.0  # sandboxes alive (rollout + grading), summed
    turns: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)  # error type -> count (aborted and timed out)
    resolved: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, sample: RolloutSample, sandbox_seconds: float) -> None:
        self.rollouts += 1
        self.turns += len(sample.turns)
        self.policy_seconds += sample.policy_seconds
        self.sandbox_seconds += sandbox_seconds
        self.statuses[sample.status.value] += 1
        self.resolved += sample.resolved
        if sample.error_type:
            self.failures[sample.error_type] += 1

    def summary(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        per = max(self.rollouts, 1)
        return {"rollouts": self.rollouts, "rollouts_per_second": round(self.rollouts / elapsed, 2),
                "turns_per_second": round(self.turns / elapsed, 1),
                "sandbox_seconds_per_rollout": round(self.sandbox_seconds / per, 3),
                "policy_seconds_per_rollout": round(self.policy_seconds / per, 3),
                "statuses": dict(self.statuses), "failures": dict(self.failures), "resolved": self.resolved}


class RolloutEngine:
    """Rollouts of tasks by one policy on one client's backend (``async with`` it)."""

    def __init__(self, client: AsyncClient, policy: Policy, config: Optional[EngineConfig] = None) -> None:
        self.client = client
        self.policy = policy
        self.config = config or EngineConfig()
        self.metrics = EngineMetrics()
        self._slots = asyncio.Semaphore(self.config.max_concurrent)
        self._prepared: dict[str, PreparedTask] = {}
        self._attempts: Counter = Counter()

    def state_dict(self) -> dict[str, int]:
        """Each task's next attempt number: a resumed run names its rollouts (and so keys a
        seeded policy's draws) as the uninterrupted run would."""
        return dict(self._attempts)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._attempts = Counter(state)

    async def __aenter__(self) -> "RolloutEngine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def prepared(self, task: Task) -> PreparedTask:
        """The task's starting state, keyed by the task's whole content (not its id alone): two
        tasks under one id (other tests, another test patch) share no snapshot and no verdict."""
        key = self._key(task)
        if key not in self._prepared:
            self._prepared[key] = PreparedTask(self.client, task, **self.config.sandbox)
        return self._prepared[key]

    @staticmethod
    def _key(task: Task) -> str:
        return f"{task.task_id}@{hashlib.sha256(task.model_dump_json().encode()).hexdigest()}"

    async def release(self, task: Task) -> None:
        """Forget a task's starting state (its snapshot) when no more rollouts of it come."""
        prepared = self._prepared.pop(self._key(task), None)
        if prepared is not None:
            await prepared.close()

    async def close(self) -> None:
        for prepared in list(self._prepared.values()):
            await prepared.close()
        self._prepared.clear()

    # -- rollouts ----------------------------------------------------------------------
    async def rollout(self, task: Task, attempt: Optional[int] = None) -> RolloutSample:
        """One graded episode of ``task``; never raises for the environment's failures (the
        sample is ``aborted`` instead)."""
        if attempt is None:
            attempt = self._attempts[task.task_id]
        self._attempts[task.task_id] = max(self._attempts[task.task_id], attempt + 1)
        limit = (self.config.rollout.time_limit_seconds or task.time_limit_seconds) + self.config.grace_seconds
        async with self._slots:
            lifetimes: list[float] = []
            try:
                sample = await asyncio.wait_for(self._graded_episode(task, attempt, lifetimes), limit)
            except asyncio.TimeoutError:
                sample = RolloutSample(task.task_id, attempt, RolloutStatus.TIMED_OUT,
                                       error=f"cut off as a straggler after {limit:g} s", error_type="timeout")
            except OrchardError as exc:  # preparing failed
                sample = RolloutSample(task.task_id, attempt, RolloutStatus.ABORTED, error=exc.message,
                                       error_type=exc.error_type)
        self.metrics.add(sample, sum(lifetimes))
        return sample

    async def _graded_episode(self, task: Task, attempt: int, lifetimes: list[float]) -> RolloutSample:
        prepared = self.prepared(task)
        sandbox = await prepared.sandbox()
        born = time.monotonic()
        sample = RolloutSample(task.task_id, attempt, RolloutStatus.ABORTED, sandbox_id=sandbox.id)
        try:
            sample = await run_episode(self.policy, sandbox, task, self.config.rollout, attempt)
            if sample.status in GRADED and self.config.grade:
                sample.diff = await extract_diff(sandbox, task)
        except OrchardError as exc:  # the episode's conversation is kept, for whoever looks into it
            _abort(sample, exc)
        finally:
            await delete_sandbox(sandbox)  # to the end, cancellation or not
            lifetimes.append(time.monotonic() - born)
        if sample.status in GRADED and self.config.grade:
            born = time.monotonic()
            try:
                sample.grade = await grade(prepared, sample.diff)
                unsubmitted = sample.status == RolloutStatus.TRUNCATED and self.config.rollout.submit_required
                sample.reward = 1.0 if sample.grade.resolved and not unsubmitted else -1.0
            except OrchardError as exc:  # the grading sandbox failed: no verdict, no reward
                _abort(sample, exc)
            finally:
                lifetimes.append(time.monotonic() - born)
        return sample

    async def group(self, task: Task, k: int) -> list[RolloutSample]:
        """``k`` more rollouts of ``task``, run concurrently (attempt numbers continue)."""
        first = self._attempts[task.task_id]
        self._attempts[task.task_id] += k
        return await gather_all([self.rollout(task, first + n) for n in range(k)])

    def generator(self, task: Task):
        """BAR's ``generate(k)`` for one task: k rollouts as BAR reads them."""
        async def generate(k: int) -> list[Rollout]:
            return [sample.to_bar() for sample in await self.group(task, k)]
        return generate

    async def run(self, tasks: list[Task], attempts: int = 1, progress: bool = False) -> list[RolloutSample]:
        """``attempts`` rollouts of every task, all at once within the concurrency bound;
        each task's snapshot is dropped as soon as its last rollout is done."""
        from orchard.rollout.progress import RolloutProgress

        remaining = Counter({task.task_id: attempts for task in tasks})

        async def one(task: Task, attempt: int) -> RolloutSample:
            sample = await self.rollout(task, attempt)
            remaining[task.task_id] -= 1
            if remaining[task.task_id] == 0:
                await self.release(task)
            bar.advance(sample)
            return sample

        with RolloutProgress(len(tasks) * attempts, enabled=progress) as bar:
            return await gather_all([one(task, n) for task in tasks for n in range(attempts)])


def _abort(sample: RolloutSample, exc: OrchardError) -> None:
    """The environment failed this rollout: ``aborted``, no grade and no reward (never -1)."""
    sample.status, sample.error, sample.error_type = RolloutStatus.ABORTED, exc.message, exc.error_type
    sample.grade, sample.reward = None, None


async def gather_all(steps: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every step's result, run concurrently (public: slime's rollout function groups prompts
    with it). Cancelled (or one failing), the others are
    cancelled and *waited for* before this returns (``gather`` returns at the first cancelled
    child), so their sandboxes and snapshots are deleted before the caller goes on to close."""
    running = [asyncio.ensure_future(step) for step in steps]
    try:
        return list(await asyncio.gather(*running))
    except BaseException:
        for task in running:
            if not task.cancelling():  # a second cancel would cut a cancelled task's cleanup short
                task.cancel()
        if running:
            await finish(asyncio.wait(running))
        raise
