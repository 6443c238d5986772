"""Credit assignment: which action each credit belongs to, segments, masks, SFT examples,
ensembles and calibration."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from orchard.train.calibration import (
    TemperatureScaling, brier, calibration_report, expected_calibration_error,
)
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
    assert action_mask(trajectory(True), values) == [True] * 5
    assert action_mask(trajectory(False), values) == [False, True, False, True, False]
    with pytest.raises(ValueError, match="need 6 values"):
        action_mask(trajectory(False), values[:-1])


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
    report = calibration_report(overconfident, outcomes)
    assert report["temperature"] == pytest.approx(3.0, rel=0.2)
    assert report["brier_after"] < report["brier_before"] and report["ece_after"] < report["ece_before"]
    assert TemperatureScaling(1.0).apply(0.7) == pytest.approx(0.7)
    with pytest.raises(ValueError):
        brier([1.2], [1])
