"""Credit assignment: which action each credit belongs to, segments, masks, SFT examples,
ensembles and calibration."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from orchard.train.calibration import TemperatureScaling, brier, expected_calibration_error
from orchard.train.credit import (
    EnsembleEstimator, Step, Trajectory, ValueEstimator, action_mask, ascending_segments, credits,
    load_trajectories, save_jsonl, sft_example,
)


def trajectory(resolved: bool, n: int = 5) -> Trajectory:
    return Trajectory("t1", "fix the bug", [Step(f"a{i}", f"o{i}") for i in range(n)], resolved)


def test_credit_t_belongs_to_the_action_taken_in_state_t():
    values = [0.2, 0.2, 0.6, 0.5, 0.9, 0.9]  # V(0..5) for 5 actions
    c = credits(values)
    assert c == pytest.approx([0.0, 0.4, -0.1, 0.4, 0.0])
    # a1 moved the odds from V(1)=0.2 to V(2)=0.6: its credit is c[1]
    assert c[1] == pytest.approx(values[2] - values[1])


def test_ascending_segments_are_maximal_runs_above_the_threshold():
    assert ascending_segments([0.1, 0.2, -0.1, 0.3, 0.0, 0.05]) == [(0, 1), (3, 3), (5, 5)]
    assert ascending_segments([0.1, 0.2, -0.1, 0.3, 0.0, 0.05], threshold=0.1) == [(1, 1), (3, 3)]
    assert ascending_segments([]) == [] and ascending_segments([-1.0, 0.0]) == []


def test_masks_all_actions_of_resolved_and_the_ascending_ones_of_failed():
    values = [0.2, 0.2, 0.6, 0.5, 0.9, 0.1]
    assert action_mask(trajectory(True), values) == action_mask(trajectory(True), None) == [True] * 5
    assert action_mask(trajectory(False), values) == [False, True, False, True, False]
    with pytest.raises(ValueError, match="need 6 values"):
        action_mask(trajectory(False), values[:-1])
    with pytest.raises(ValueError, match="need 6 values"):
        action_mask(trajectory(False), None)


def test_sft_example_trains_exactly_the_masked_assistant_turns():
    traj = trajectory(False)
    mask = [False, True, False, True, False]
    example = sft_example(traj, mask, system="You are an agent.")
    trained = [m["content"] for m in example.messages if m["loss_mask"]]
    assert trained == ["a1", "a3"]
    assert all(m["role"] == "assistant" for m in example.messages if m["loss_mask"])
    assert [m["role"] for m in example.messages[:4]] == ["system", "user", "assistant", "user"]


def test_trajectory_jsonl_round_trip_and_errors(tmp_path):
    path = tmp_path / "trajs.jsonl"
    save_jsonl([trajectory(True).to_dict(), trajectory(False).to_dict()], path)
    loaded = load_trajectories(path)
    assert loaded[0] == trajectory(True) and loaded[1].resolved is False
    path.write_text(json.dumps({"task": "x"}) + "\n")
    with pytest.raises(ValueError, match=":1:"):
        load_trajectories(path)


class Fixed(ValueEstimator):
    def __init__(self, values):
        self.fixed = values

    async def values(self, trajectory, with_outcome=True):
        return list(self.fixed)


def test_ensemble_is_the_weighted_mean():
    ensemble = EnsembleEstimator([Fixed([0.0, 1.0]), Fixed([1.0, 0.0])], weights=[3, 1])
    assert asyncio.run(ensemble.values(trajectory(True, 1))) == pytest.approx([0.25, 0.75])
    with pytest.raises(ValueError):
        EnsembleEstimator([])


def test_calibration_metrics_and_temperature_scaling():
    assert brier([1.0, 0.0], [1, 0]) == 0 and brier([0.5], [1]) == 0.25
    assert expected_calibration_error([0.9] * 10, [1] * 9 + [0]) == pytest.approx(0.0)
    rng = random.Random(0)
    truth = [rng.random() for _ in range(2000)]
    outcomes = [int(rng.random() < p) for p in truth]
    overconfident = [1 / (1 + ((1 - p) / p) ** 3) if 0 < p < 1 else p for p in truth]  # logit x 3
    scaling = TemperatureScaling.fit(overconfident, outcomes)
    assert scaling.temperature == pytest.approx(3.0, rel=0.2)
    after = scaling.apply_all(overconfident)
    assert brier(after, outcomes) < brier(overconfident, outcomes)
    assert expected_calibration_error(after, outcomes) < expected_calibration_error(overconfident, outcomes)
    assert TemperatureScaling(1.0).apply(0.7) == pytest.approx(0.7)
    with pytest.raises(ValueError):
        brier([1.2], [1])


class Scripted(ValueEstimator):
    """Outcome-blind forecasts and hindsight values by trajectory; records what was asked."""

    def __init__(self, forecast, hindsight):
        self.forecast, self.hindsight = forecast, hindsight
        self.asked: list[tuple[str, bool]] = []

    async def values(self, trajectory, with_outcome=True):
        self.asked.append((trajectory.task_id, with_outcome))
        return list((self.hindsight if with_outcome else self.forecast)(trajectory))


def test_calibration_is_fitted_on_some_tasks_and_scored_on_the_others():
    from orchard.train.calibration import held_out_calibration, split_tasks

    rng = random.Random(1)
    tasks = [f"task{i // 2}" for i in range(400)]  # two attempts per task: they must stay on one side
    truth = [rng.random() for _ in tasks]
    outcomes = [int(rng.random() < p) for p in truth]
    forecasts = [[1 / (1 + ((1 - p) / p) ** 3)] * 3 for p in truth]  # over-confident: logit x 3
    fit_tasks, held_tasks = split_tasks(tasks, 0.5)
    assert not set(fit_tasks) & set(held_tasks) and set(fit_tasks) | set(held_tasks) == set(tasks)
    assert split_tasks(list(reversed(tasks)), 0.5) == (fit_tasks, held_tasks)  # not the input order
    scaling, report = held_out_calibration(forecasts, outcomes, tasks, 0.5)
    held = [i for i, t in enumerate(tasks) if t in set(held_tasks)]
    fit = [i for i, t in enumerate(tasks) if t not in set(held_tasks)]
    held_p = [p for i in held for p in forecasts[i]]
    held_y = [outcomes[i] for i in held for _ in forecasts[i]]
    expected = TemperatureScaling.fit([p for i in fit for p in forecasts[i]], [outcomes[i] for i in fit for _ in range(3)])
    assert report["temperature"] == pytest.approx(expected.temperature) == pytest.approx(3.0, rel=0.25)
    assert report["held_out_tasks"] == len(held_tasks) and report["held_out_points"] == len(held_p)
    assert report["brier_before"] == pytest.approx(brier(held_p, held_y))
    assert report["brier_after"] == pytest.approx(brier(expected.apply_all(held_p), held_y))
    assert report["ece_before"] == pytest.approx(expected_calibration_error(held_p, held_y))
    assert report["brier_after"] < report["brier_before"] and report["ece_after"] < report["ece_before"]
    assert report["applied"] is True and scaling.temperature == pytest.approx(expected.temperature)


def test_calibration_needs_two_tasks_and_a_held_out_gain():
    from orchard.train.calibration import held_out_calibration, split_tasks

    scaling, report = held_out_calibration([[0.9, 0.8]] * 3, [1, 0, 1], ["same"] * 3)
    assert scaling is None and report["applied"] is False and "2 tasks" in report["skipped"]
    # 0.9 is over-confident on the fitting task (half resolved) and right on the held-out one (all
    # resolved): the softening temperature fitted on one hurts the other, so it is not offered
    (fit,), (held,) = split_tasks(["a", "b"])
    scaling, report = held_out_calibration([[0.9, 0.9]] * 8, [1, 0, 1, 0, 1, 1, 1, 1], [fit] * 4 + [held] * 4)
    assert report["temperature"] > 5 and report["brier_after"] > report["brier_before"]
    assert scaling is None and report["applied"] is False


def _calibration_world():
    """20 tasks, 7 of 10 resolved on each side of the split; every forecast says 0.9, so the
    fitted temperature (logit 0.9 -> logit 0.7) is about 2.6 and improves the held-out part."""
    from orchard.train.calibration import split_tasks

    ids = [f"task{i}" for i in range(20)]
    fit, held = split_tasks(ids, 0.5)
    resolved = {t for side in (fit, held) for t in side[:7]}
    trajs = [Trajectory(t, "fix", [Step(f"a{k}", f"o{k}") for k in range(3)], t in resolved) for t in ids]
    return trajs, Scripted(lambda t: [0.9] * 4, lambda t: [0.5, 0.62, 0.9, 0.95])


def test_the_held_out_temperature_is_applied_to_the_values_before_the_masks():
    from orchard.train.credit_pipeline import build_sft_dataset

    trajs, estimator = _calibration_world()
    result = asyncio.run(build_sft_dataset(trajs, estimator, threshold=0.1, calibrate=True))
    calibration = result.report["calibration"]
    assert calibration["applied"] is True and calibration["temperature"] == pytest.approx(2.594, rel=0.01)
    scaling = TemperatureScaling(calibration["temperature"])
    failed = [e for e in result.examples if not e["resolved"]]
    assert len(failed) == 6
    for example in failed:
        # raw credits 0.12, 0.28, 0.05 -> a0 and a1 ascend; calibrated 0.05, 0.15, 0.06 -> only a1
        assert example["values"] == pytest.approx(scaling.apply_all([0.5, 0.62, 0.9, 0.95]))
        assert [m["content"] for m in example["messages"] if m["loss_mask"]] == ["a1"]
    assert calibration["changed_actions"] == 6


def test_calibration_report_only_leaves_the_values_alone():
    from orchard.train.credit_pipeline import build_sft_dataset

    trajs, estimator = _calibration_world()
    result = asyncio.run(build_sft_dataset(trajs, estimator, threshold=0.1, calibrate=True, apply_calibration=False))
    assert result.report["calibration"]["applied"] is False
    for example in (e for e in result.examples if not e["resolved"]):
        assert example["values"] == [0.5, 0.62, 0.9, 0.95]
        assert [m["content"] for m in example["messages"] if m["loss_mask"]] == ["a0", "a1"]


def test_failed_trajectories_without_ascent_are_dropped_and_counted():
    from orchard.train.credit_pipeline import build_sft_dataset

    flat = Trajectory("flat", "x", [Step("a", "b"), Step("c", "d")], resolved=False)
    rising = Trajectory("rising", "x", [Step("a", "b"), Step("c", "d")], resolved=False)
    solved = Trajectory("solved", "x", [Step("a", "b")], resolved=True)
    scripted = {"flat": [0.5, 0.4, 0.1], "rising": [0.2, 0.6, 0.1]}
    estimator = Scripted(lambda t: [], lambda t: scripted.get(t.task_id, [0.5] * (len(t.steps) + 1)))
    result = asyncio.run(build_sft_dataset([flat, rising, solved], estimator))
    assert [e["task_id"] for e in result.examples] == ["rising", "solved"]
    assert all(any(m["loss_mask"] for m in e["messages"]) for e in result.examples)
    assert result.report["dropped_untrained"] == 1 and result.report["trajectories"] == 3


def test_resolved_trajectories_are_not_graded():
    from orchard.train.credit_pipeline import build_sft_dataset

    failed = Trajectory("failed", "x", [Step("a", "b")], resolved=False)
    solved = Trajectory("solved", "x", [Step("a", "b")], resolved=True)
    estimator = Scripted(lambda t: [0.5, 0.5], lambda t: [0.2, 0.6])
    result = asyncio.run(build_sft_dataset([failed, solved], estimator))
    assert estimator.asked == [("failed", True)]
    assert [m["loss_mask"] for m in result.examples[1]["messages"] if m["role"] == "assistant"] == [1]
    assert result.examples[1]["values"] is None


def test_credit_resolved_leaves_out_the_descending_actions_of_a_resolved_trajectory():
    """A wrong try that the trajectory undid before it found the fix: trained by the original's
    rule, left out with ``credit_resolved``; neutral actions (a look, the submit) stay."""
    values = [1 / 6, 1 / 6, 0.0, 1 / 6, 1.0, 1.0]  # look, wrong candidate, undo, the fix, submit
    assert action_mask(trajectory(True), values) == [True] * 5
    assert action_mask(trajectory(True), values, credit_resolved=True) == [True, False, True, True, True]
    assert action_mask(trajectory(True), [0.2, 0.15, 0.1, 0.5, 0.9, 1.0], threshold=0.1,
                       credit_resolved=True) == [True, True, True, True, True]  # small dips within the threshold
    with pytest.raises(ValueError, match="need 6 values"):
        action_mask(trajectory(True), None, credit_resolved=True)


def test_credit_resolved_grades_resolved_trajectories_too():
    from orchard.train.credit_pipeline import build_sft_dataset

    failed = Trajectory("failed", "x", [Step("a", "b")], resolved=False)
    recovered = Trajectory("recovered", "x", [Step("wrong", "b"), Step("undo", "c"), Step("fix", "d"), Step("submit")],
                           resolved=True)
    scripted = {"failed": [0.2, 0.6], "recovered": [1 / 6, 0.0, 1 / 6, 1.0, 1.0]}
    estimator = Scripted(lambda t: [], lambda t: scripted[t.task_id])
    result = asyncio.run(build_sft_dataset([failed, recovered], estimator, credit_resolved=True))
    assert sorted(estimator.asked) == [("failed", True), ("recovered", True)]
    trained = [m["content"] for m in result.examples[1]["messages"] if m["loss_mask"]]
    assert trained == ["undo", "fix", "submit"] and result.examples[1]["values"] == scripted["recovered"]
    assert result.report["credit_resolved"] is True and result.report["trained_actions"] == 4
