"""The GRPO objective: against TRL's own loss code on identical tensors, finite
differences, gradient accumulation, masks."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from orchard.train.grpo import BatchSize, GRPOLossConfig, group_advantages, grpo_loss  # noqa: E402


def make_batch(seed: int = 0, batch: int = 8, length: int = 12, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=dtype) * 3
    logps = (old + torch.randn(batch, length, generator=g, dtype=dtype) * 0.3).requires_grad_(True)
    ref = old + torch.randn(batch, length, generator=g, dtype=dtype) * 0.2
    rollout = old + torch.randn(batch, length, generator=g, dtype=dtype) * 0.1
    mask = (torch.rand(batch, length, generator=g) > 0.25).to(dtype)
    mask[0] = 0  # one sequence with no trainable token at all
    advantages = torch.randn(batch, generator=g, dtype=dtype)
    return logps, old, ref, rollout, mask, advantages


class _Accelerator:
    """Single process: gather and reduce are the identity."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(loss_type, logps, old, mask, advantages, *, eps_low, eps_high, beta=0.0, ref=None, is_ratio=None,
             max_completion_length=None):
    """TRL's GRPOTrainer._compute_loss run on given tensors. Only the trainer's shell is a
    stand-in (its model forward returns our log-probs); the loss arithmetic is TRL's."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    shell = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_completion_length,
        accelerator=_Accelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(logps.shape[0], 1, dtype=torch.long),
              "prompt_mask": torch.ones(logps.shape[0], 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old,
              "num_items_in_batch": mask.sum()}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(shell, None, inputs)


@pytest.mark.parametrize("ours,theirs", [("grpo", "grpo"), ("dapo", "dapo"), ("dapo", "bnpo"), ("dr_grpo", "dr_grpo")])
@pytest.mark.parametrize("with_kl_and_tis", [False, True])
def test_matches_trl(ours, theirs, with_kl_and_tis):
    pytest.importorskip("trl")
    logps, old, ref, rollout, mask, adv = make_batch(seed=3)
    kwargs = dict(eps_low=0.2, eps_high=0.28)
    config = GRPOLossConfig(aggregation=ours, max_length=logps.shape[1], **kwargs,
                            kl_coef=0.04 if with_kl_and_tis else 0.0, tis_cap=2.0 if with_kl_and_tis else None)
    mine, _ = grpo_loss(logps, old, adv, mask, config, ref_logps=ref, rollout_logps=rollout)
    extra = {}
    if with_kl_and_tis:
        extra = {"beta": 0.04, "ref": ref, "is_ratio": torch.exp(old - rollout).clamp(max=2.0)}
    theirs_loss = trl_loss(theirs, logps, old, mask, adv, max_completion_length=logps.shape[1], **kwargs, **extra)
    assert torch.allclose(mine, theirs_loss, atol=1e-12), (float(mine), float(theirs_loss))
    grad_mine = torch.autograd.grad(mine, logps, retain_graph=True)[0]
    grad_theirs = torch.autograd.grad(theirs_loss, logps)[0]
    assert torch.allclose(grad_mine, grad_theirs, atol=1e-12)


@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo"])
def test_finite_difference_gradients(aggregation):
    logps, old, ref, rollout, mask, adv = make_batch(seed=5, batch=4, length=6)
    config = GRPOLossConfig(aggregation=aggregation, kl_coef=0.1, tis_cap=1.5, dual_clip=3.0, eps_low=0.2,
                            eps_high=0.28, max_length=logps.shape[1])

    def loss_of(x):
        return grpo_loss(x, old, adv, mask, config, ref_logps=ref, rollout_logps=rollout)[0]

    assert torch.autograd.gradcheck(loss_of, (logps,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo"])
def test_gradient_accumulation_equals_the_whole_batch(aggregation):
    logps, old, ref, rollout, mask, adv = make_batch(seed=7, batch=8)
    config = GRPOLossConfig(aggregation=aggregation, kl_coef=0.02, max_length=logps.shape[1])
    whole, _ = grpo_loss(logps, old, adv, mask, config, ref_logps=ref)
    grad_whole = torch.autograd.grad(whole, logps)[0]
    size = BatchSize(sequences=8, tokens=int(mask.sum()))
    total = 0.0
    for part in range(4):  # 4 micro-batches of 2, with uneven token counts
        rows = slice(2 * part, 2 * part + 2)
        loss, _ = grpo_loss(logps[rows], old[rows], adv[rows], mask[rows], config, ref_logps=ref[rows], batch=size)
        total = total + loss
    grad_accumulated = torch.autograd.grad(total, logps)[0]
    assert torch.allclose(total, whole, atol=1e-12)
    assert torch.allclose(grad_accumulated, grad_whole, atol=1e-12)


AGGREGATIONS = ["grpo", "dapo", "dr_grpo"]


def test_dr_grpo_needs_max_length():
    # Its normalizer is a constant; a padded length differs between micro-batches (and with
    # the padding policy), so defaulting to it made accumulated losses inexact.
    with pytest.raises(ValueError, match="max_length"):
        GRPOLossConfig(aggregation="dr_grpo")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_accumulation_is_exact_with_unevenly_padded_micro_batches(aggregation):
    logps, old, ref, rollout, mask, adv = make_batch(seed=13, batch=8, length=12)
    lengths = torch.tensor([12, 10, 5, 4, 9, 7, 3, 2])  # completion lengths; past them is padding
    mask = mask * (torch.arange(12) < lengths[:, None])
    config = GRPOLossConfig(aggregation=aggregation, kl_coef=0.02, tis_cap=2.0, max_length=16)
    whole, _ = grpo_loss(logps, old, adv, mask, config, ref_logps=ref, rollout_logps=rollout)
    grad_whole = torch.autograd.grad(whole, logps)[0]
    size = BatchSize(sequences=8, tokens=int(mask.sum()))
    total = 0.0
    for part in range(4):  # each micro-batch padded to its own longest completion: 12, 5, 9, 3
        rows = slice(2 * part, 2 * part + 2)
        width = int(lengths[rows].max())
        loss, _ = grpo_loss(logps[rows, :width], old[rows, :width], adv[rows], mask[rows, :width], config,
                            ref_logps=ref[rows, :width], rollout_logps=rollout[rows, :width], batch=size)
        total = total + loss
    grad_accumulated = torch.autograd.grad(total, logps)[0]
    assert torch.allclose(total, whole, atol=1e-12), (float(total), float(whole))
    assert torch.allclose(grad_accumulated, grad_whole, atol=1e-12)


INF = float("inf")
NAN = float("nan")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("garbage", [
    {"logps": -INF, "old": -INF, "ref": -INF, "rollout": -INF},  # -inf - -inf: NaN everywhere
    {"logps": 1e4},  # the ratio overflows to inf
    {"old": -INF},  # the ratio is inf, the importance weight 0
    {"ref": -INF},  # the k3 KL is inf
    {"old": 1e4, "rollout": -INF},  # the importance weight is inf before its cap
    {"logps": NAN, "old": NAN, "ref": NAN, "rollout": NAN},
], ids=["all-neg-inf", "ratio-overflow", "old-neg-inf", "ref-neg-inf", "weight-overflow", "nan"])
def test_garbage_at_padded_positions_changes_nothing(aggregation, garbage):
    logps, old, ref, rollout, mask, adv = make_batch(seed=17)
    config = GRPOLossConfig(aggregation=aggregation, kl_coef=0.1, tis_cap=2.0, dual_clip=3.0,
                            max_length=logps.shape[1])
    clean, _ = grpo_loss(logps, old, adv, mask, config, ref_logps=ref, rollout_logps=rollout)
    grad_clean = torch.autograd.grad(clean, logps)[0]
    pad = mask == 0
    tensors = {"logps": logps.detach(), "old": old, "ref": ref, "rollout": rollout}
    dirty = {name: t.masked_fill(pad, garbage[name]) if name in garbage else t for name, t in tensors.items()}
    dirty_logps = dirty["logps"].requires_grad_(True)
    loss, stats = grpo_loss(dirty_logps, dirty["old"], adv, mask, config, ref_logps=dirty["ref"],
                            rollout_logps=dirty["rollout"])
    grad = torch.autograd.grad(loss, dirty_logps)[0]
    assert torch.isfinite(loss) and torch.all(torch.isfinite(grad)), (float(loss), grad)
    assert torch.allclose(loss, clean, atol=1e-12)
    assert torch.allclose(grad, grad_clean, atol=1e-12)
    assert all(v == v for v in stats.values())  # no NaN statistics either


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_a_sample_without_reward_changes_nothing(aggregation):
    logps, old, ref, rollout, mask, _ = make_batch(seed=19, batch=9)
    mask[8] = 1  # the aborted rollout has tokens, and its log-probs look ordinary
    g = torch.Generator().manual_seed(19)
    rewards = torch.randn(1, 9, generator=g, dtype=torch.float64)
    rewards[0, 8] = NAN  # no reward: the rollout was aborted
    adv = group_advantages(rewards).flatten()
    assert torch.allclose(adv[:8], group_advantages(rewards[:, :8]).flatten()) and adv[8] == 0
    rewarded = ~torch.isnan(rewards).flatten()
    config = GRPOLossConfig(aggregation=aggregation, kl_coef=0.1, tis_cap=2.0, max_length=logps.shape[1])
    kwargs = dict(ref_logps=ref[:8], rollout_logps=rollout[:8])
    without, _ = grpo_loss(logps[:8], old[:8], adv[:8], mask[:8], config, **kwargs)
    grad_without = torch.autograd.grad(without, logps)[0]
    kwargs = dict(ref_logps=ref, rollout_logps=rollout, rewarded=rewarded)
    with_it, _ = grpo_loss(logps, old, adv, mask, config, **kwargs)
    grad_with = torch.autograd.grad(with_it, logps)[0]
    assert torch.allclose(with_it, without, atol=1e-12), (float(with_it), float(without))
    assert torch.allclose(grad_with, grad_without, atol=1e-12)
    # The same over micro-batches: the whole batch's size leaves the sample out too.
    size = BatchSize.of(mask, rewarded)
    assert size == BatchSize(sequences=8, tokens=int(mask[:8].sum()))
    total = 0.0
    for rows in (slice(0, 4), slice(4, 9)):
        loss, _ = grpo_loss(logps[rows], old[rows], adv[rows], mask[rows], config, ref_logps=ref[rows],
                            rollout_logps=rollout[rows], rewarded=rewarded[rows], batch=size)
        total = total + loss
    assert torch.allclose(total, without, atol=1e-12)
    assert torch.allclose(torch.autograd.grad(total, logps)[0], grad_without, atol=1e-12)


def test_masked_tokens_get_zero_gradient():
    logps, old, ref, rollout, mask, adv = make_batch(seed=11)
    loss, _ = grpo_loss(logps, old, adv, mask, GRPOLossConfig(kl_coef=0.1), ref_logps=ref)
    grad = torch.autograd.grad(loss, logps)[0]
    assert torch.all(grad[mask == 0] == 0)
    assert torch.any(grad[mask == 1] != 0)


def test_clip_higher_and_dual_clip():
    old = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    up = torch.log(torch.tensor([[1.5, 1.5]], dtype=torch.float64)).requires_grad_(True)
    cfg = GRPOLossConfig(eps_low=0.2, eps_high=0.28)
    loss, stats = grpo_loss(up, old, torch.tensor([1.0], dtype=torch.float64), mask, cfg)
    assert torch.isclose(loss, torch.tensor(-1.28, dtype=torch.float64)) and stats["clip_high"] == 1.0
    assert torch.all(torch.autograd.grad(loss, up)[0] == 0)  # clipped: no gradient
    far = torch.log(torch.tensor([[10.0, 10.0]], dtype=torch.float64))
    plain, _ = grpo_loss(far, old, torch.tensor([-1.0], dtype=torch.float64), mask, cfg)
    dual, _ = grpo_loss(far, old, torch.tensor([-1.0], dtype=torch.float64), mask,
                        GRPOLossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0))
    assert float(plain) == pytest.approx(10.0) and float(dual) == pytest.approx(3.0)


def test_group_advantages():
    rewards = torch.tensor([[1.0, -1.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0], [1.0, float("nan"), -1.0, -1.0]])
    adv = group_advantages(rewards)
    std = torch.tensor([1.0, -1.0, 1.0, -1.0]).std()
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, 1.0, -1.0]) / (std + 1e-4))
    assert torch.all(adv[1] == 0)  # all equal: no signal
    assert adv[2, 1] == 0 and adv[2, 0] > 0 > adv[2, 2]  # NaN: no reward, no advantage, no effect on the group
    mean_only = group_advantages(torch.tensor([[1.0, -1.0, -1.0, -1.0]]), scale=False)
    assert torch.allclose(mean_only, torch.tensor([[1.5, -0.5, -0.5, -0.5]]))


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError):
        GRPOLossConfig(aggregation="mean")
    with pytest.raises(ValueError):
        GRPOLossConfig(dual_clip=0.5)
    logps, old, ref, rollout, mask, adv = make_batch()
    with pytest.raises(ValueError, match="rollout_logps"):
        grpo_loss(logps, old, adv, mask, GRPOLossConfig(tis_cap=2.0))
