"""slime's reward post-process: group-relative advantages for uneven BAR groups.

``reward_post_process`` (``--custom-reward-post-process-path``): slime's default reshapes the
batch's rewards into rows of ``--n-samples-per-prompt`` and normalizes each row
(``RolloutManager._post_process_rewards``: mean, then std + 1e-6), so a zero-weight slot
(an aborted or missing rollout in a BAR group) would move its group's mean and std. Here
samples are grouped by ``group_index``, slots that do not count (``remove_sample``, no
reward, Orchard's ``valid`` False) are NaN, and the standalone trainer's own
:func:`~orchard.train.grpo.group_advantages` gives the advantages (0 for those slots):
the same numbers ``RLTrainer`` trains on for the same groups. It returns ``(raw_rewards,
rewards)`` as slime's hook must; with ``--advantage-estimator grpo`` slime uses the second
list as each sample's advantage.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from orchard.train.grpo import group_advantages

NORMALIZED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
SCALED = ("grpo", "gspo", "cispo")


def _flat(samples: list[Any]) -> list[Any]:
    while samples and isinstance(samples[0], list):
        samples = [s for group in samples for s in group]
    return samples


def counts(sample: Any) -> bool:
    """Whether a sample takes part in its group's statistics."""
    info = (sample.metadata or {}).get("orchard", {})
    return not getattr(sample, "remove_sample", False) and sample.reward is not None and info.get("valid", True)


def _reward(sample: Any, args: Any) -> float:
    value = sample.reward
    if isinstance(value, dict):
        value = value[args.reward_key]
    return 0.0 if value is None or not counts(sample) else float(value)


def reward_post_process(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """``(raw_rewards, rewards)`` for slime: per ``group_index``, the standalone GRPO advantages."""
    samples = _flat(samples)
    raw = [_reward(s, args) for s in samples]
    estimator = getattr(args, "advantage_estimator", "grpo")
    if not getattr(args, "rewards_normalization", True) or estimator not in NORMALIZED:
        return raw, list(raw)
    rows: dict[Any, list[int]] = {}
    for position, sample in enumerate(samples):
        key = sample.group_index if sample.group_index is not None else ("alone", position)
        rows.setdefault(key, []).append(position)
    width = max((len(r) for r in rows.values()), default=0)
    table = torch.full((len(rows), max(width, 1)), math.nan)
    for row, positions in enumerate(rows.values()):
        for col, position in enumerate(positions):
            if counts(samples[position]):
                table[row, col] = raw[position]
    scale = estimator in SCALED and getattr(args, "grpo_std_normalization", True)
    advantages = group_advantages(table, scale=bool(scale))
    out = [0.0] * len(samples)
    for row, positions in enumerate(rows.values()):
        for col, position in enumerate(positions):
            out[position] = float(advantages[row, col])
    return raw, out
