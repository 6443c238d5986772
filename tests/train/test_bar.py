"""BAR's selection rules and edge cases, and the adaptive band."""

from __future__ import annotations

import asyncio
import math

import pytest

from orchard.train.bar import (
    AdaptiveBand, Band, BARConfig, Outcome, Rollout, bar_sample, fallback_group, select_group,
)

POS, NEG = 1.0, -1.0


def rollouts(*rewards, outcome=Outcome.COMPLETED):
    return [Rollout(r, outcome, payload=i) for i, r in enumerate(rewards)]


def scripted(*batches):
    """A generator that hands out the given rollouts in order, and records the calls."""
    stream = [r for batch in batches for r in batch]
    calls: list[int] = []

    async def generate(n: int) -> list[Rollout]:
        calls.append(n)
        taken, stream[:] = stream[:n], stream[n:]
        return taken

    return generate, calls


def run(generate, config, band=None):
    return asyncio.run(bar_sample(generate, config, band))


def test_prefers_the_count_nearest_the_band_middle_and_the_best_samples():
    pool = rollouts(POS, 0.5, 2.0, NEG, -0.5, NEG, NEG, NEG, NEG, NEG)
    group = select_group(pool, 4, Band(0.25, 0.75))
    assert sum(r.positive for r in group) == 2  # the middle of [1, 3]
    assert [r.reward for r in group[:2]] == [2.0, POS]  # best positives
    assert group[2].reward == -0.5  # then the best negative


def test_infeasible_band_gives_none():
    assert select_group(rollouts(POS, NEG, NEG, NEG), 4, Band(0.5, 0.75)) is None
    assert select_group(rollouts(POS, POS), 4, Band(0.0, 1.0)) is None  # fewer than G samples


def test_stops_at_the_first_stride_that_allows_a_group():
    config = BARConfig(group_size=4, max_rollouts=16, stride=4, band=Band(0.25, 0.75))
    generate, calls = scripted(rollouts(NEG, NEG, NEG, NEG), rollouts(POS, NEG, POS, NEG), rollouts(POS) * 8)
    selection = run(generate, config)
    assert calls == [4, 4] and selection.rollouts_spent == 8 and selection.stride_found == 2
    assert selection.fallback is None and selection.positives == 2 and selection.informative


def test_budget_that_is_not_a_multiple_of_the_stride():
    config = BARConfig(group_size=2, max_rollouts=7, stride=3, band=Band(0.5, 0.5))
    generate, calls = scripted(rollouts(*([NEG] * 7)))
    selection = run(generate, config)
    assert calls == [3, 3, 1] and selection.rollouts_spent == 7


def test_all_positive_and_all_negative_fall_back_to_the_relaxed_band():
    config = BARConfig(group_size=4, max_rollouts=8, stride=4)
    for reward in (POS, NEG):
        generate, _ = scripted(rollouts(*([reward] * 8)))
        selection = run(generate, config)
        assert selection.fallback == "relaxed" and selection.stride_found is None
        assert len(selection.group) == 4 and not selection.informative


def test_fewer_than_g_valid_samples_fall_back_to_the_best_ordering():
    pool = (rollouts(NEG, outcome=Outcome.ABORTED) + rollouts(None) + rollouts(float("nan"))
            + rollouts(POS, outcome=Outcome.TIMED_OUT) + rollouts(NEG, outcome=Outcome.TRUNCATED)
            + rollouts(POS) + rollouts(NEG, outcome=Outcome.TIMED_OUT) + rollouts(NEG, outcome=Outcome.ABORTED))
    config = BARConfig(group_size=4, max_rollouts=8, stride=8)
    generate, _ = scripted(pool)
    selection = run(generate, config)
    assert selection.fallback == "ordering"
    assert [r.outcome for r in selection.group[:2]] == [Outcome.COMPLETED, Outcome.TRUNCATED]  # the valid ones
    assert all(r.outcome <= Outcome.TIMED_OUT for r in selection.group)  # aborted ones come last of all


def test_invalid_samples_never_count():
    assert not Rollout(POS, Outcome.TIMED_OUT).positive and not Rollout(POS, Outcome.ABORTED).valid
    assert not Rollout(None).valid and not Rollout(float("nan")).valid
    assert Rollout(POS, Outcome.TRUNCATED).positive and not Rollout(NEG, Outcome.TRUNCATED).positive
    pool = rollouts(POS, NEG, NEG, NEG) + rollouts(POS, POS, POS, outcome=Outcome.TIMED_OUT)
    assert select_group(pool, 4, Band(0.5, 0.75)) is None


def test_fallback_ordering_with_rewardless_samples():
    pool = [Rollout(None, Outcome.COMPLETED), Rollout(NEG, Outcome.ABORTED), Rollout(NEG, Outcome.TRUNCATED)]
    assert fallback_group(pool, 3)[0].outcome == Outcome.TRUNCATED  # the only valid one first


def test_bad_configs():
    with pytest.raises(ValueError):
        Band(0.8, 0.2)
    with pytest.raises(ValueError):
        BARConfig(group_size=8, max_rollouts=4)


def test_adaptive_band_reaches_down_for_rare_successes_but_stays_informative():
    config = BARConfig(group_size=8, max_rollouts=32, stride=8, band=Band(0.25, 0.75))
    adaptive = AdaptiveBand(config.band, config)
    assert adaptive.band_for("p") == config.band  # nothing seen yet: the static band
    rare = run(scripted(rollouts(*([POS] + [NEG] * 31)))[0], config)
    assert rare.fallback == "relaxed"  # the static band needs 2 successes; 1 in 32 came
    adaptive.observe("p", rare)
    band = adaptive.band_for("p")
    assert band.rho_min == pytest.approx(1 / 8) and band.rho_max == 0.75
    again = run(scripted(rollouts(*([POS] + [NEG] * 31)))[0], config, band)
    assert again.fallback is None and again.informative and again.positives == 1
    common = run(scripted(rollouts(*([POS] * 31 + [NEG])))[0], config)
    adaptive.observe("q", common)
    assert adaptive.band_for("q").rho_max == pytest.approx(7 / 8)
    assert 1 / 8 <= adaptive.band_for("new").rho_min  # unknown prompts use the global window


def test_adaptive_band_state_round_trips():
    config = BARConfig()
    adaptive = AdaptiveBand(config.band, config)
    adaptive.observe("a", run(scripted(rollouts(*([POS] * 3 + [NEG] * 29)))[0], config))
    restored = AdaptiveBand(config.band, config)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.band_for("a") == adaptive.band_for("a") and restored.estimate("b") == adaptive.estimate("b")
    assert math.isclose(restored.estimate("a"), 3 / 8)  # BAR stopped after the first stride: 3 of 8


def test_adaptive_sampling_keeps_the_static_band_while_the_budget_lasts():
    config = BARConfig(group_size=8, max_rollouts=32, stride=8, band=Band(0.25, 0.75))
    adaptive = AdaptiveBand(config.band, config)
    first = asyncio.run(adaptive.sample("p", scripted(rollouts(*([POS] + [NEG] * 31)))[0]))
    assert first.fallback == "relaxed"  # nothing known yet: static BAR
    # Known to be hard now: 1 success early, 2 more later. The static band is met at stride 3,
    # not settled for at stride 1, so balance is what static BAR would get.
    stream = rollouts(*([POS] + [NEG] * 15 + [POS] + [NEG] * 15))
    second = asyncio.run(adaptive.sample("p", scripted(stream)[0]))
    assert second.stride_found == 3 and second.positives == 2
    third = asyncio.run(adaptive.sample("p", scripted(rollouts(*([POS] + [NEG] * 31)))[0]))
    assert third.fallback is None and third.positives == 1 and third.band.rho_min == pytest.approx(1 / 8)
