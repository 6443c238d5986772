"""BAR's selection rules and edge cases, and the adaptive band's plans."""

from __future__ import annotations

import asyncio
import random

import pytest

from orchard.train.bar import (
    AdaptiveBand, Band, BARConfig, Outcome, Plan, Rollout, Selection, bar_sample, fallback_group, select_group,
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


def run(generate, config, band=None, first_stride=None):
    return asyncio.run(bar_sample(generate, config, band, first_stride))


def known(adaptive, prompt, *pools):
    """Tell the band about past pools of a prompt, each given as (successes, rollouts)."""
    for wins, n in pools:
        pool = rollouts(*([POS] * wins + [NEG] * (n - wins)))
        adaptive.observe(prompt, Selection([], n, None, None, adaptive.base, pool))


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


def test_a_first_stride_of_its_own_then_the_configured_stride():
    config = BARConfig(group_size=4, max_rollouts=16, stride=3, band=Band(0.25, 0.75))
    generate, calls = scripted(rollouts(*([NEG] * 16)))
    selection = run(generate, config, first_stride=7)
    assert calls == [7, 3, 3, 3] and selection.rollouts_spent == 16 and selection.fallback == "relaxed"


HARD_STREAM = [POS] + [NEG] * 15 + [POS] + [NEG] * 15  # a second success only in the third stride of 8


def test_adaptive_band_acts_before_the_budget_is_spent():
    """A prompt known to be hard (1 success in 32): static BAR draws three strides to find a
    second success; the adaptive plan accepts one success out of a larger first stride.
    (The band that only relabelled the relaxed fallback spent the same 24 rollouts.)"""
    config = BARConfig(group_size=8, max_rollouts=32, stride=8, band=Band(0.25, 0.75))
    static = run(scripted(rollouts(*HARD_STREAM))[0], config)
    assert static.stride_found == 3 and static.rollouts_spent == 24 and static.positives == 2
    adaptive = AdaptiveBand(config.band, config)
    adaptive.observe("p", run(scripted(rollouts(*([POS] + [NEG] * 31)))[0], config))
    generate, calls = scripted(rollouts(*HARD_STREAM))
    chosen = asyncio.run(adaptive.sample("p", generate))
    assert chosen.rollouts_spent < static.rollouts_spent and len(calls) < 3
    assert chosen.fallback is None and chosen.informative and chosen.positives == 1
    assert chosen.band.rho_min == pytest.approx(1 / 8) and chosen.band.rho_max == 0.75


def test_adaptive_and_static_bar_differ_on_random_prompts():
    """Random prompts, each with one past pool: the adaptive plan changes the group or the
    cost in a good share of cases, stays within the budget and fills every group."""
    rng = random.Random(0)
    config = BARConfig(group_size=8, max_rollouts=32, stride=8, band=Band(0.25, 0.75))
    cases = 1000

    def draws(p, n):
        return [Rollout(POS if rng.random() < p else NEG, payload=rng.random()) for _ in range(n)]

    def ids(selection):
        return sorted(r.payload for r in selection.group)

    async def compare():
        differ = cheaper = dearer = 0
        for _ in range(cases):
            p = rng.random() ** 2  # more hard prompts than easy ones, as SWE tasks
            adaptive = AdaptiveBand(config.band, config)
            adaptive.observe("q", await bar_sample(scripted(draws(p, 32))[0], config))
            stream = draws(p, 32)
            static = await bar_sample(scripted(list(stream))[0], config)
            chosen = await adaptive.sample("q", scripted(list(stream))[0])
            assert len(chosen.group) == 8 and chosen.rollouts_spent <= 32
            differ += (chosen.rollouts_spent, ids(chosen)) != (static.rollouts_spent, ids(static))
            cheaper += chosen.rollouts_spent < static.rollouts_spent
            dearer += chosen.rollouts_spent > static.rollouts_spent
        return differ, cheaper, dearer

    differ, cheaper, dearer = asyncio.run(compare())
    assert differ >= 0.1 * cases and cheaper and dearer


def test_adaptive_plan_is_static_bar_while_nothing_is_known():
    config = BARConfig(group_size=8, max_rollouts=32, stride=8, band=Band(0.25, 0.75))
    adaptive = AdaptiveBand(config.band, config)
    assert adaptive.plan("p") == Plan(config.band, 32, 8) and adaptive.estimate("p") is None
    generate, calls = scripted(rollouts(*([NEG] * 32)))
    assert asyncio.run(adaptive.sample("p", generate)).fallback == "relaxed" and calls == [8, 8, 8, 8]


def test_the_band_widens_towards_the_side_the_prompt_lacks():
    config = BARConfig(group_size=8, max_rollouts=32, stride=8, band=Band(0.25, 0.75))
    hard, easy, balanced = (AdaptiveBand(config.band, config) for _ in range(3))
    known(hard, "p", (1, 32))
    known(easy, "p", (31, 32))
    known(balanced, "p", (16, 32))
    assert hard.band_for("p") == Band(1 / 8, 0.75)
    assert easy.band_for("p") == Band(0.25, 7 / 8)
    assert balanced.plan("p") == Plan(config.band, 32, 8, balanced.plan("p").reach)


def test_the_first_stride_grows_for_hard_prompts_but_never_below_the_configured_one():
    config = BARConfig(group_size=8, max_rollouts=32, stride=8, band=Band(0.25, 0.75))
    hard = AdaptiveBand(config.band, config)
    known(hard, "p", (3, 32))
    assert hard.plan("p").band == config.band and 8 < hard.plan("p").first_stride < 32
    small = BARConfig(group_size=8, max_rollouts=32, stride=4, band=Band(0.25, 0.75))
    balanced = AdaptiveBand(small.band, small)
    known(balanced, "p", (16, 32))
    assert balanced.plan("p").first_stride == 8  # a group needs G anyway: one round, not two
    wide = BARConfig(group_size=8, max_rollouts=32, stride=16, band=Band(0.25, 0.75))
    known(third := AdaptiveBand(wide.band, wide), "p", (16, 32))
    assert third.plan("p").first_stride == 16


def test_a_prompt_that_looks_hopeless_gets_a_probe_of_g_rollouts():
    config = BARConfig(group_size=8, max_rollouts=32, stride=8, band=Band(0.25, 0.75))
    adaptive = AdaptiveBand(config.band, config)
    known(adaptive, "others", *[(2, 32)] * 8)  # 6% of rollouts succeed overall
    known(adaptive, "p", *[(0, 32)] * 4)
    plan = adaptive.plan("p")
    assert plan.probe and plan.budget == 8 and plan.reach < adaptive.hopeless
    assert not adaptive.plan("new").probe  # no pool of its own: never cut
    generate, calls = scripted(rollouts(*([NEG] * 32)))
    probe = asyncio.run(adaptive.sample("p", generate))
    assert calls == [8] and probe.rollouts_spent == 8 and len(probe.group) == 8
    broken = rollouts(NEG, NEG, NEG, outcome=Outcome.ABORTED) + rollouts(*([NEG] * 29))
    generate, calls = scripted(broken)
    replaced = asyncio.run(adaptive.sample("p", generate))
    assert calls == [8, 3] and all(r.valid for r in replaced.group)  # broken rollouts are replaced
    generate, calls = scripted(rollouts(*([POS] + [NEG] * 31)))
    lucky = asyncio.run(adaptive.sample("p", generate))
    assert calls == [8] and lucky.informative and lucky.fallback is None and lucky.positives == 1
    assert not adaptive.plan("p").probe  # one success, and the prompt gets the whole budget again


def test_adaptive_band_state_round_trips():
    config = BARConfig()
    adaptive = AdaptiveBand(config.band, config)
    adaptive.observe("a", run(scripted(rollouts(*([POS] * 3 + [NEG] * 29)))[0], config))
    known(adaptive, "b", (1, 32))
    restored = AdaptiveBand(config.band, config)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.state_dict() == adaptive.state_dict()
    for prompt in ("a", "b", "c"):
        assert restored.plan(prompt) == adaptive.plan(prompt)
    assert restored.prompt_counts["a"][0] == (3.0, 8.0)  # BAR stopped after the first stride: 3 of 8
    legacy = AdaptiveBand(config.band, config)
    legacy.load_state_dict({"global_rates": [0.5, 0.25], "prompt_rates": {"a": [0.25]}})
    assert legacy.estimate("a") == pytest.approx((2 * 0.375 + 0.25) / 3)
