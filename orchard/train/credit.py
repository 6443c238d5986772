"""Credit assignment for SFT: which actions of a trajectory deserve training.

A trajectory is a task, steps (action, then the observation it produced) and an outcome.
A value estimator gives ``V(0..T)``: ``V(t)`` is the probability that the task ends
resolved, judged from the history up to state ``t`` (``V(0)``: the task alone; ``V(t)``
for ``t >= 1``: after action ``t-1`` and its observation). The credit of action ``a_t``
(0-based) is ``c_t = V(t+1) - V(t)``: how much that action, with what it revealed, moved
the odds. Ascending segments are maximal runs of consecutive actions whose credit
exceeds a threshold. The SFT loss then covers every action of resolved trajectories and
the ascending-segment actions of failed ones, so failed attempts still teach their good
stretches.
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence


@dataclass
class Step:
    action: str
    observation: str = ""


@dataclass
class Trajectory:
    task_id: str
    task: str
    steps: list[Step]
    resolved: bool

    @classmethod
    def from_dict(cls, data: dict) -> "Trajectory":
        try:
            steps = [Step(**step) for step in data["steps"]]
            return cls(str(data["task_id"]), str(data["task"]), steps, bool(data["resolved"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a trajectory (needs task_id, task, steps[action, observation], resolved): {exc}") from None

    def to_dict(self) -> dict:
        return asdict(self)


def load_trajectories(path: Path) -> list[Trajectory]:
    """JSONL, one trajectory per line; errors name the line."""
    trajectories = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                trajectories.append(Trajectory.from_dict(json.loads(line)))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
    return trajectories


def save_jsonl(records: Iterable[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


class ValueEstimator(ABC):
    """Estimates ``V(0..T)`` for a trajectory (T + 1 numbers in [0, 1])."""

    @abstractmethod
    async def values(self, trajectory: Trajectory, with_outcome: bool = True) -> list[float]:
        """``with_outcome=False`` asks for a forecast that does not see the outcome (for calibration)."""


class EnsembleEstimator(ValueEstimator):
    """The weighted mean of several estimators (teachers)."""

    def __init__(self, members: Sequence[ValueEstimator], weights: Optional[Sequence[float]] = None) -> None:
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = list(members)
        self.weights = list(weights) if weights is not None else [1.0] * len(self.members)
        if len(self.weights) != len(self.members) or any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError("weights must be non-negative, one per member, not all zero")

    async def values(self, trajectory: Trajectory, with_outcome: bool = True) -> list[float]:
        estimates = await asyncio.gather(*(m.values(trajectory, with_outcome) for m in self.members))
        total = sum(self.weights)
        return [sum(w * est[t] for w, est in zip(self.weights, estimates)) / total for t in range(len(estimates[0]))]


def credits(values: Sequence[float]) -> list[float]:
    """``c_t = V(t+1) - V(t)`` for each action t (one fewer than the values)."""
    if len(values) < 1:
        raise ValueError("need V(0..T)")
    return [values[t + 1] - values[t] for t in range(len(values) - 1)]


def ascending_segments(step_credits: Sequence[float], threshold: float = 0.0) -> list[tuple[int, int]]:
    """Maximal runs of consecutive actions with credit > threshold, as (first, last) inclusive."""
    segments, start = [], None
    for t, credit in enumerate(step_credits):
        if credit > threshold and start is None:
            start = t
        elif credit <= threshold and start is not None:
            segments.append((start, t - 1))
            start = None
    if start is not None:
        segments.append((start, len(step_credits) - 1))
    return segments


def action_mask(trajectory: Trajectory, values: Optional[Sequence[float]], threshold: float = 0.0,
                credit_resolved: bool = False) -> list[bool]:
    """Which actions to train on: all of a resolved trajectory, the ascending ones of a failed one.

    A resolved trajectory needs no values (``None``): every action is trained whatever they
    say, so asking a teacher for them would be wasted; given, they are still checked. With
    ``credit_resolved``, a resolved trajectory is trained except for its descending actions
    (credit below ``-threshold``: they lowered the odds, like a wrong try it later undid; the
    original's rule trains them, and on our generated tasks that cost about 40 points of
    first-choice accuracy). Its neutral actions (a look around, the final submit) stay."""
    if values is None and trajectory.resolved and not credit_resolved:
        return [True] * len(trajectory.steps)
    if values is None or len(values) != len(trajectory.steps) + 1:
        got = "none" if values is None else len(values)
        raise ValueError(f"need {len(trajectory.steps) + 1} values for {len(trajectory.steps)} steps, got {got}")
    if trajectory.resolved:
        return [True] * len(trajectory.steps) if not credit_resolved else [c >= -threshold for c in credits(values)]
    mask = [False] * len(trajectory.steps)
    for first, last in ascending_segments(credits(values), threshold):
        for t in range(first, last + 1):
            mask[t] = True
    return mask


@dataclass
class SFTExample:
    """Chat messages with a per-message loss mask (a tokenizer turns it into per-token masks;
    slime's ``loss_mask`` takes the result)."""

    task_id: str
    messages: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"task_id": self.task_id, "messages": self.messages}


def sft_example(trajectory: Trajectory, mask: Sequence[bool], system: Optional[str] = None) -> SFTExample:
    """The trajectory as chat: task (user), then each action (assistant, ``loss_mask`` 0/1) and
    its observation (tool output as a user turn, never trained)."""
    messages = [{"role": "system", "content": system, "loss_mask": 0}] if system else []
    messages.append({"role": "user", "content": trajectory.task, "loss_mask": 0})
    for step, train in zip(trajectory.steps, mask):
        messages.append({"role": "assistant", "content": step.action, "loss_mask": int(train)})
        if step.observation:
            messages.append({"role": "user", "content": step.observation, "loss_mask": 0})
    return SFTExample(trajectory.task_id, messages)
