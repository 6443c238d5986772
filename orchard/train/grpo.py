"""The GRPO objective, as the practice around it has settled, in one function.

Group-relative advantages; a token-level ratio with asymmetric clipping ("clip-higher":
``eps_low`` below, ``eps_high`` above); optional dual clip for negative advantages;
optional KL to a reference policy (the k3 estimator); truncated importance sampling to
correct the mismatch between the rollout engine's log-probs and the trainer's; loss masks
(tool and observation tokens excluded); three aggregations, each exact under gradient
accumulation because the normalizer is the whole batch's, never the micro-batch's:

- ``grpo``: mean over sequences of each sequence's token mean;
- ``dapo``: mean over all tokens of the batch;
- ``dr_grpo``: sum over tokens divided by a constant (sequences x ``max_length``).

``max_length`` is required for ``dr_grpo``: a padded length differs between micro-batches
(and with the padding policy), so it cannot be the constant. Padded and masked positions are
overwritten before any arithmetic, because -inf log-probs there would give inf * 0 = NaN in
the loss or, through ``exp``'s backward, in the gradients. Samples without a reward (an
aborted rollout; ``rewarded`` False) count in no numerator and no denominator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

Aggregation = Literal["grpo", "dapo", "dr_grpo"]


@dataclass
class GRPOLossConfig:
    """Hyper-parameters of the objective (defaults follow DAPO's clip-higher)."""

    eps_low: float = field(default=0.2, metadata={"help": "ratio clip below 1 - eps_low"})
    eps_high: float = field(default=0.28, metadata={"help": "ratio clip above 1 + eps_high (clip-higher)"})
    dual_clip: Optional[float] = field(default=None, metadata={
        "help": "c > 1: for negative advantages the loss is at most c * |A| (dual-clip PPO)"})
    kl_coef: float = field(default=0.0, metadata={"help": "weight of the k3 KL estimate to the reference policy"})
    aggregation: Aggregation = field(default="grpo", metadata={"help": "grpo | dapo | dr_grpo"})
    max_length: Optional[int] = field(default=None, metadata={
        "help": "dr_grpo's constant: the maximum completion length (required by dr_grpo)"})
    tis_cap: Optional[float] = field(default=None, metadata={
        "help": "truncated importance sampling: weight tokens by min(pi_old / pi_rollout, cap)"})

    def __post_init__(self) -> None:
        if self.aggregation not in ("grpo", "dapo", "dr_grpo"):
            raise ValueError(f"aggregation must be grpo, dapo or dr_grpo, not {self.aggregation!r}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError("dual_clip must be greater than 1")
        if self.eps_low < 0 or self.eps_high < 0:
            raise ValueError("eps_low and eps_high must be non-negative")
        if self.aggregation == "dr_grpo" and (self.max_length is None or self.max_length < 1):
            # Not a padded length: that differs between micro-batches, so accumulation would be inexact.
            raise ValueError("dr_grpo needs max_length (the maximum completion length), a positive constant")


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Advantages of a ``(groups, group_size)`` reward tensor: ``(r - mean) / (std + eps)``
    per group, or ``r - mean`` alone (Dr. GRPO) with ``scale=False``. NaN rewards (no score)
    get advantage 0 and do not move their group's statistics."""
    if rewards.dim() != 2:
        raise ValueError("rewards must have shape (groups, group_size)")
    valid = ~torch.isnan(rewards)
    count = valid.sum(dim=1, keepdim=True).clamp(min=1)
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))
    mean = filled.sum(dim=1, keepdim=True) / count
    advantages = torch.where(valid, rewards - mean, torch.zeros_like(rewards))
    if scale:
        var = (advantages ** 2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        advantages = advantages / (var.sqrt() + eps)
    return advantages


@dataclass
class BatchSize:
    """The whole batch's size, for micro-batches that are parts of it (gradient accumulation).

    Counts only samples with a reward; build it with :meth:`of` so that it agrees with what
    ``grpo_loss`` counts, and add the sizes of parts that are padded differently."""

    sequences: int
    tokens: int

    @classmethod
    def of(cls, mask: torch.Tensor, rewarded: Optional[torch.Tensor] = None) -> "BatchSize":
        """The size of a ``(B, T)`` loss mask, leaving out rows whose ``rewarded`` is False."""
        keep = mask != 0
        if rewarded is not None:
            keep = keep & rewarded.to(torch.bool).unsqueeze(1)
        sequences = mask.shape[0] if rewarded is None else int(rewarded.sum().item())
        return cls(sequences=sequences, tokens=int(keep.sum().item()))

    def __add__(self, other: "BatchSize") -> "BatchSize":
        return BatchSize(self.sequences + other.sequences, self.tokens + other.tokens)


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig,
    ref_logps: Optional[torch.Tensor] = None,
    rollout_logps: Optional[torch.Tensor] = None,
    batch: Optional[BatchSize] = None,
    rewarded: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one (micro-)batch and a few statistics.

    Shapes: ``logps``, ``old_logps``, ``ref_logps``, ``rollout_logps`` and ``mask`` are
    ``(B, T)``; ``advantages`` is ``(B,)`` or ``(B, T)``; ``rewarded`` is ``(B,)``, False for
    samples without a reward (NaN), which then count nowhere. ``batch`` gives the whole
    batch's size (:meth:`BatchSize.of`) when this is one micro-batch of several; summing the
    returned losses over the micro-batches then gives exactly the loss of the whole batch.
    Micro-batches may be padded to different lengths.
    """
    keep = mask != 0
    if rewarded is not None:
        keep = keep & rewarded.to(torch.bool).unsqueeze(1)
    mask = mask.to(logps.dtype).masked_fill(~keep, 0.0)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    # Before any arithmetic, not after: where() after exp() still back-propagates 0 * inf = NaN.
    logps, old_logps = logps.masked_fill(~keep, 0.0), old_logps.masked_fill(~keep, 0.0)
    advantages = torch.where(keep, advantages, torch.zeros((), dtype=advantages.dtype))
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - config.eps_low, 1 + config.eps_high)
    objective = torch.min(ratio * advantages, clipped * advantages)
    if config.dual_clip is not None:
        objective = torch.where(advantages < 0, torch.max(objective, config.dual_clip * advantages), objective)
    per_token = -objective
    if config.tis_cap is not None:
        if rollout_logps is None:
            raise ValueError("tis_cap needs rollout_logps (the rollout engine's log-probs)")
        rollout_logps = rollout_logps.masked_fill(~keep, 0.0)
        weight = torch.exp(old_logps - rollout_logps).clamp(max=config.tis_cap).detach()
        per_token = per_token * weight
    kl = None
    if config.kl_coef:
        if ref_logps is None:
            raise ValueError("kl_coef needs ref_logps")
        delta = ref_logps.masked_fill(~keep, 0.0) - logps
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        per_token = per_token + config.kl_coef * kl
    size = batch if batch is not None else BatchSize.of(mask, rewarded)
    sequences, tokens = size.sequences, size.tokens
    if config.aggregation == "grpo":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = per_sequence.sum() / max(sequences, 1)
    elif config.aggregation == "dapo":
        loss = (per_token * mask).sum() / max(tokens, 1)
    else:
        assert config.max_length is not None  # GRPOLossConfig requires it for dr_grpo
        loss = (per_token * mask).sum() / (max(sequences, 1) * config.max_length)
    with torch.no_grad():
        active = mask.sum().clamp(min=1.0)
        low = ((ratio < 1 - config.eps_low) & (advantages < 0)).to(mask.dtype)
        high = ((ratio > 1 + config.eps_high) & (advantages > 0)).to(mask.dtype)
        stats = {"clip_low": float((low * mask).sum() / active), "clip_high": float((high * mask).sum() / active),
                 "ratio_mean": float((ratio * mask).sum() / active)}
        if kl is not None:
            stats["kl"] = float((kl * mask).sum() / active)
    return loss, stats
