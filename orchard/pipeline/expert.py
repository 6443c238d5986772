"""A scripted, noisy expert for choice tasks, and the ground-truth value estimator.

The expert applies a candidate (the right one with probability ``p_correct``), runs the
tests, and then: after a failure it recovers (undoes and applies the right fix) with
probability ``p_recover``; after a success it sometimes undoes its own good work
(``p_undo``) before submitting. So failed trajectories hold good steps (a right fix later
undone) and bad ones, which is what credit assignment is for.

``GroundTruthValues`` is not an LLM teacher: it knows each task's fix and replays a
trajectory's actions, so ``V(t)`` is 1 while the right candidate is applied, 0 while a wrong
one is, and 1/K (K candidates) while nothing is; after the last action it is the outcome. It stands in for a teacher where none is
configured, and is named as such in the report.
"""

from __future__ import annotations

import random
import re
from typing import Optional, Sequence

from orchard.pipeline.choice import CANDIDATES
from orchard.rollout.actions import SUBMIT_TURN, bash_block
from orchard.rollout.policy import Context
from orchard.rollout.policies.scripted import ScriptedPolicy
from orchard.rollout.sample import RolloutSample
from orchard.tasks import Task
from orchard.train.credit import Step, Trajectory, ValueEstimator

TEST_COMMAND = "python3 -B -m unittest discover -s tests -t . 2>&1 | tail -n 1"  # -B: see gen_repo.TEST_COMMAND
UNDO = "git checkout -- ."
_APPLY = re.compile(rf"git apply {re.escape(CANDIDATES)}/([A-Za-z0-9_]+)\.diff")


def apply_command(name: str) -> str:
    return f"git apply {CANDIDATES}/{name}.diff"


class NoisyExpert(ScriptedPolicy):
    name = "noisy-expert"

    def __init__(self, tasks: Sequence[Task], p_correct: float = 0.5, p_recover: float = 0.5, p_undo: float = 0.25,
                 seed: Optional[int] = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)  # for conversations outside the rollout loop (no rollout key)
        self.p_correct, self.p_recover, self.p_undo = p_correct, p_recover, p_undo
        self.by_statement = {task.problem_statement.strip(): task.metadata["choice"] for task in tasks}
        super().__init__(self._turn)

    def write(self, context: Context, turn: int) -> str:
        """Each rollout's draws come from its own stream, keyed by the seed, the rollout
        (task and attempt) and the turn: the trajectories of a seed are the same whatever
        order concurrent rollouts ran in (one shared generator made them differ run to run)."""
        rng = random.Random(f"{self.seed}/{context.rollout}/{turn}") if context.rollout else self.rng
        return self._turn([dict(m) for m in context.messages], turn, rng)

    def _choice(self, messages: list[dict[str, str]]) -> dict:
        prompt = next(m["content"] for m in messages if m["role"] == "user")
        for statement, choice in self.by_statement.items():
            if prompt.startswith(statement):
                return choice
        raise ValueError("the expert was not given this task")

    def _turn(self, messages: list[dict[str, str]], turn: int, rng: Optional[random.Random] = None) -> str:
        """apply a candidate; test; then recover, undo or submit; test a recovery; submit."""
        rng = rng or self.rng
        choice = self._choice(messages)
        fix, wrong = choice["fix"], [c for c in choice["candidates"] if c != choice["fix"]]
        previous = [m["content"] for m in messages if m["role"] == "assistant"]
        if turn == 0:
            return bash_block(apply_command(fix if not wrong or rng.random() < self.p_correct
                                            else rng.choice(wrong)))
        if turn == 1:
            return bash_block(TEST_COMMAND)
        if turn == 2:
            passed = messages[-1]["content"].rstrip().endswith("OK")
            if not passed and rng.random() < self.p_recover:
                return bash_block(f"{UNDO} && {apply_command(fix)}")
            if passed and rng.random() < self.p_undo:
                return bash_block(UNDO)
            return SUBMIT_TURN
        if turn == 3 and apply_command(fix) in previous[-1]:
            return bash_block(TEST_COMMAND)
        return SUBMIT_TURN


def applied_after(actions: Sequence[str]) -> list[Optional[str]]:
    """The candidate applied after each action (None: none), replaying ``git apply`` and undo."""
    current: Optional[str] = None
    states = []
    for action in actions:
        if UNDO in action or "git reset --hard" in action:
            current = None
        match = _APPLY.search(action)
        if match:
            current = match.group(1) if current is None else "__conflict__"  # a second apply on top: not clean
        states.append(current)
    return states


class GroundTruthValues(ValueEstimator):
    """V(t) from the task's known fix (see the module docstring); the same with or without the outcome."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.choices = {task.task_id: task.metadata["choice"] for task in tasks}

    async def values(self, trajectory: Trajectory, with_outcome: bool = True) -> list[float]:
        choice = self.choices[trajectory.task_id]
        prior = 1.0 / len(choice["candidates"])
        values = [prior]
        states = applied_after([step.action for step in trajectory.steps])
        for index, state in enumerate(states):
            if index == len(states) - 1:  # the episode ended here: resolved or not, nothing left to chance
                values.append(1.0 if state == choice["fix"] else 0.0)
            else:
                values.append(prior if state is None else (1.0 if state == choice["fix"] else 0.0))
        return values


def trajectory_of(sample: RolloutSample) -> Trajectory:
    """A graded rollout as credit assignment reads it (the task text is the user prompt)."""
    task_text = next(m["content"] for m in sample.messages if m["role"] == "user")
    steps = [Step(turn.text, turn.observation) for turn in sample.turns]
    return Trajectory(sample.task_id, task_text, steps, sample.resolved)
