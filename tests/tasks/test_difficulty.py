"""Difficulty filtering from measured pass rates."""

from __future__ import annotations

import pytest

from orchard.tasks import (
    Task, bucket_tasks, difficulty_label, filter_by_pass_rate, pass_rate, pass_rates, with_measured_rate,
)


def task(task_id: str) -> Task:
    return Task(task_id=task_id, image="host", problem_statement="p", test_commands=["true"], metadata={"kept": 1})


TASKS = [task(name) for name in ("never", "once", "half", "mostly", "always", "few", "unmeasured")]
RESULTS = {
    "never": [False] * 8, "once": [True] + [False] * 7, "half": [True, False] * 4,
    "mostly": [True] * 7 + [False], "always": [True] * 8, "few": [True, False], "ghost": [True, False] * 4,
}


def test_keeps_tasks_neither_always_nor_never_solved_in_task_order():
    kept = filter_by_pass_rate(TASKS, RESULTS)
    assert [t.task_id for t in kept] == ["once", "half", "mostly"]
    assert [t.task_id for t in filter_by_pass_rate(TASKS, RESULTS, low=0.5, high=0.5)] == ["half"]
    assert [t.task_id for t in filter_by_pass_rate(TASKS, RESULTS, min_attempts=2)] == ["once", "half", "mostly", "few"]
    assert [t.task_id for t in filter_by_pass_rate(TASKS, RESULTS, low=0.0, high=1.0)] == \
        ["never", "once", "half", "mostly", "always"]


@pytest.mark.parametrize("low,high,min_attempts", [(0.6, 0.4, 4), (-0.1, 0.5, 4), (0.1, 1.5, 4), (0.1, 0.9, 0)])
def test_bad_bounds_are_refused(low, high, min_attempts):
    with pytest.raises(ValueError):
        filter_by_pass_rate(TASKS, RESULTS, low, high, min_attempts)


def test_rates_and_labels():
    assert pass_rate([]) is None and pass_rate([True, False, False, False]) == 0.25
    assert pass_rates({"a": [True, True], "b": []}) == {"a": 1.0}
    assert [difficulty_label(r) for r in (None, 0.0, 0.01, 0.3, 0.69, 0.7, 0.99, 1.0)] == \
        ["unmeasured", "unsolved", "hard", "medium", "medium", "easy", "easy", "solved"]
    with pytest.raises(ValueError):
        difficulty_label(1.2)


def test_buckets_hold_every_task_once():
    groups = bucket_tasks(TASKS, RESULTS)
    assert {label: [t.task_id for t in ts] for label, ts in groups.items()} == {
        "solved": ["always"], "easy": ["mostly"], "medium": ["half"], "hard": ["once"], "unsolved": ["never"],
        "unmeasured": ["few", "unmeasured"]}


def test_the_measured_rate_goes_into_a_copy_of_the_task():
    original = TASKS[1]
    measured = with_measured_rate(original, RESULTS["once"])
    assert measured.metadata == {"kept": 1, "pass_rate": 0.125, "attempts": 8, "measured_difficulty": "hard"}
    assert original.metadata == {"kept": 1} and measured.difficulty is None
    assert with_measured_rate(original, [], label_difficulty=True).difficulty == "unmeasured"
    assert with_measured_rate(original, [True], label_difficulty=True).difficulty == "solved"
