"""Difficulty from measured pass rates: keep the tasks a policy sometimes solves.

GRPO learns from the spread of rewards within a group of attempts: a task solved every time,
or never, gives every attempt the same advantage and so no signal. The original trained RL
on about 2K tasks filtered this way. Measure each task with a few attempts of the current
policy, keep those whose pass rate lies in ``[low, high]``, and record the rate in the task.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from orchard.tasks.task import Task

Attempts = Mapping[str, Sequence[bool]]
# (label, lowest rate of the label), highest first: the first bound the rate reaches wins ("hard":
# solved at least once; "unsolved": never).
DEFAULT_BUCKETS: tuple[tuple[str, float], ...] = (
    ("solved", 1.0), ("easy", 0.7), ("medium", 0.3), ("hard", 1e-9), ("unsolved", 0.0),
)
UNMEASURED = "unmeasured"


def pass_rate(attempts: Sequence[bool]) -> Optional[float]:
    """The share of successful attempts (None without attempts)."""
    return sum(1 for ok in attempts if ok) / len(attempts) if attempts else None


def pass_rates(results: Attempts, min_attempts: int = 1) -> dict[str, float]:
    """Pass rate of every task with at least ``min_attempts`` attempts."""
    return {task_id: sum(map(bool, tries)) / len(tries) for task_id, tries in results.items()
            if len(tries) >= max(1, min_attempts)}


def _check_bounds(low: float, high: float, min_attempts: int) -> None:
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"need 0 <= low <= high <= 1; got low={low}, high={high}")
    if min_attempts < 1:
        raise ValueError(f"min_attempts must be at least 1; got {min_attempts}")


def filter_by_pass_rate(tasks: Iterable[Task], results: Attempts, low: float = 0.1, high: float = 0.9,
                        min_attempts: int = 4) -> list[Task]:
    """The tasks (in their order) whose measured pass rate lies in ``[low, high]``.

    A task with fewer than ``min_attempts`` attempts is dropped: its rate is not known well
    enough to say it is neither always nor never solved.
    """
    _check_bounds(low, high, min_attempts)
    rates = pass_rates(results, min_attempts)
    return [task for task in tasks if task.task_id in rates and low <= rates[task.task_id] <= high]


def difficulty_label(rate: Optional[float], buckets: Sequence[tuple[str, float]] = DEFAULT_BUCKETS) -> str:
    """The bucket a pass rate falls in (``unmeasured`` for None)."""
    if rate is None:
        return UNMEASURED
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a pass rate lies in [0, 1]; got {rate}")
    for label, lowest in buckets:
        if rate >= lowest:
            return label
    return buckets[-1][0]


def bucket_tasks(tasks: Iterable[Task], results: Attempts, min_attempts: int = 4,
                 buckets: Sequence[tuple[str, float]] = DEFAULT_BUCKETS) -> dict[str, list[Task]]:
    """Tasks grouped by difficulty label (every label present, ``unmeasured`` included)."""
    _check_bounds(0.0, 1.0, min_attempts)
    rates = pass_rates(results, min_attempts)
    groups: dict[str, list[Task]] = {label: [] for label, _ in buckets}
    groups[UNMEASURED] = []
    for task in tasks:
        groups[difficulty_label(rates.get(task.task_id), buckets)].append(task)
    return groups


def with_measured_rate(task: Task, attempts: Sequence[bool], label_difficulty: bool = False,
                       buckets: Sequence[tuple[str, float]] = DEFAULT_BUCKETS) -> Task:
    """A copy of the task with ``pass_rate``, ``attempts`` and ``measured_difficulty`` in its
    metadata; ``label_difficulty`` also sets ``difficulty`` to the measured label."""
    rate = pass_rate(attempts)
    label = difficulty_label(rate, buckets)
    metadata = {**task.metadata, "pass_rate": rate, "attempts": len(attempts), "measured_difficulty": label}
    update: dict = {"metadata": metadata}
    if label_difficulty:
        update["difficulty"] = label
    return task.model_copy(update=update, deep=True)
