"""Rollout samples as tensors for the GRPO loss, and a model's log-probs of them.

A sample's ``tokens`` are the whole sequence (prompt, turns, observations); its
``loss_mask`` is 1 exactly on tokens the policy sampled, with their behaviour log-probs in
``logprobs``. Token ``t`` is predicted by the logits at ``t - 1``, so every per-token
tensor here has length ``T - 1`` and describes tokens ``1..T-1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from orchard.rollout.sample import RolloutSample


@dataclass
class TokenBatch:
    """Padded ``(B, T)`` ids and ``(B, T-1)`` per-token targets, masks and behaviour log-probs."""

    ids: torch.Tensor
    attention: torch.Tensor
    mask: torch.Tensor  # 1 on sampled tokens (the loss), for tokens 1..T-1
    behaviour_logps: torch.Tensor  # the sampler's log-probs of those tokens
    advantages: torch.Tensor  # (B,)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def token_batch(samples: Sequence[RolloutSample], advantages: Sequence[float], pad_id: int) -> TokenBatch:
    """Left-aligned, right-padded tensors of ``samples`` (each must carry tokens)."""
    if not samples:
        raise ValueError("no samples")
    for sample in samples:
        if not sample.tokens:
            raise ValueError(f"sample {sample.task_id}#{sample.attempt} has no tokens: RL needs a policy that "
                             "records them (huggingface, or openai with token_ids)")
    length = max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), length), dtype=torch.long)
    mask = torch.zeros((len(samples), length - 1))
    behaviour = torch.zeros((len(samples), length - 1))
    for row, sample in enumerate(samples):
        n = len(sample.tokens)
        ids[row, :n] = torch.tensor(sample.tokens)
        attention[row, :n] = 1
        mask[row, :n - 1] = torch.tensor(sample.loss_mask[1:], dtype=mask.dtype)
        behaviour[row, :n - 1] = torch.tensor(sample.logprobs[1:], dtype=behaviour.dtype)
    return TokenBatch(ids, attention, mask, behaviour, torch.tensor(list(advantages), dtype=torch.float32))


def token_logprobs(model: Any, batch: TokenBatch, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T-1)`` log-probs of tokens 1..T-1 under ``model`` (raw logits, temperature 1),
    and their entropies when asked (zeros otherwise)."""
    device = next(model.parameters()).device
    logits = model(input_ids=batch.ids.to(device), attention_mask=batch.attention.to(device)).logits[:, :-1].float()
    logps = torch.log_softmax(logits, dim=-1)
    targets = batch.ids[:, 1:].to(device)
    chosen = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen, torch.zeros_like(chosen)
    with torch.no_grad():
        entropy = -(logps.exp() * logps).sum(-1)
    return chosen, entropy
