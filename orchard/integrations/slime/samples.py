"""Orchard rollouts as slime ``Sample`` objects, with the invariants slime's trainer checks.

slime (THUDM/slime, ``slime/utils/types.py`` and ``slime/ray/rollout.py``) trains on
``Sample.tokens`` (prompt then response), ``response_length`` (the response's share of
``tokens``), ``loss_mask`` and ``rollout_log_probs`` (one entry per response token),
``reward`` and ``status``. An Orchard rollout records the whole sequence with a per-token
mask (1 exactly on sampled tokens) and log-probs, so the response is everything after
the prompt: observations and template glue stay in it with mask 0.

slime is imported only when a sample is built and no class was handed in
(:func:`set_sample_class`, or the ``sample_class`` argument): importing this package
never needs slime.
"""

from __future__ import annotations

from typing import Any, Optional

from orchard.rollout.sample import RolloutSample, RolloutStatus

_SAMPLE_CLASS: Optional[type] = None
INSTALL_HINT = ("THUDM's slime is not installed: install it from its git repository "
                "(pip install git+https://github.com/THUDM/slime), not the unrelated PyPI package named 'slime'")


class SlimeNotInstalled(ImportError):
    """slime's own code is needed and cannot be imported."""


def set_sample_class(cls: Optional[type]) -> None:
    """Use ``cls`` as slime's ``Sample`` (tests hand in a stand-in; None: import slime's)."""
    global _SAMPLE_CLASS
    _SAMPLE_CLASS = cls


def sample_class(cls: Optional[type] = None) -> type:
    """slime's ``Sample`` class: ``cls``, the one set, or ``slime.utils.types.Sample``."""
    if cls is not None:
        return cls
    if _SAMPLE_CLASS is not None:
        return _SAMPLE_CLASS
    try:
        from slime.utils.types import Sample
    except ImportError as exc:
        raise SlimeNotInstalled(INSTALL_HINT) from exc
    return Sample


def slime_status(sample_type: type, status: Optional[RolloutStatus]) -> Any:
    """slime's status for an Orchard one: a timed-out rollout is FAILED (no reward, the
    policy's turn never ended), an aborted one or an empty slot ABORTED."""
    names = {RolloutStatus.COMPLETED: "COMPLETED", RolloutStatus.TRUNCATED: "TRUNCATED",
             RolloutStatus.TIMED_OUT: "FAILED", RolloutStatus.ABORTED: "ABORTED", None: "ABORTED"}
    return getattr(sample_type.Status, names[status])


def orchard_info(rollout: Optional[RolloutSample], valid: bool) -> dict[str, Any]:
    """What slime's metadata keeps of the Orchard rollout (for logs and the reward post-process)."""
    if rollout is None:
        return {"valid": False, "status": None}
    return {"valid": valid, "status": rollout.status.value, "task_id": rollout.task_id, "attempt": rollout.attempt,
            "error": rollout.error, "error_type": rollout.error_type, "turns": len(rollout.turns),
            "resolved": rollout.resolved, "diff": str(rollout.diff),
            "diff_refused": getattr(rollout.diff, "reason", None)}


def fill_sample(sample: Any, rollout: Optional[RolloutSample], valid: bool, prompt_tokens: list[int],
                pad_id: int) -> Any:
    """Write ``rollout`` into slime's ``sample`` in place.

    A valid rollout (finished with a reward) trains: its reward, its mask. Anything else
    (aborted, timed out, no rollout at all for this slot) is a zero-weight sample:
    ``remove_sample`` set, mask all 0, reward 0.0, so slime's fixed-size group keeps its
    size without the slot counting anywhere. A response needs at least one token, so an
    empty one gets ``pad_id`` (mask 0, log-prob 0.0)."""
    if rollout is not None and rollout.tokens:
        start = rollout.prompt_length
        tokens, mask, logprobs = list(rollout.tokens), rollout.loss_mask[start:], rollout.logprobs[start:]
    else:
        start, tokens, mask, logprobs = len(prompt_tokens), list(prompt_tokens), [], []
    if not valid:
        mask = [0] * len(mask)
    if not mask:
        tokens, mask, logprobs = tokens + [pad_id], [0], [0.0]
    sample.tokens = tokens
    sample.response_length = len(mask)
    sample.loss_mask = [int(m) for m in mask]
    sample.rollout_log_probs = [float(p) for p in logprobs]
    sample.reward = float(rollout.reward) if valid and rollout is not None else 0.0  # type: ignore[arg-type]
    sample.status = slime_status(type(sample), rollout.status if rollout is not None else None)
    sample.remove_sample = not valid
    sample.response = "".join(m["content"] for m in (rollout.messages if rollout else [])[2:]
                              if m.get("role") == "assistant")
    sample.metadata = {**(sample.metadata or {}), "orchard": orchard_info(rollout, valid)}
    check_sample(sample)
    return sample


def check_sample(sample: Any) -> None:
    """slime's own checks of a rollout sample (``Sample._validate_response_metadata_lengths``
    and ``RolloutManager._convert_samples_to_train_data``), raised here, where the cause is."""
    n = sample.response_length
    if not 0 < n <= len(sample.tokens):
        raise ValueError(f"response_length {n} is not within the {len(sample.tokens)} tokens")
    if sample.loss_mask is None or len(sample.loss_mask) != n:
        raise ValueError(f"loss_mask length {len(sample.loss_mask or [])} != response_length {n}")
    if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) != n:
        raise ValueError(f"rollout_log_probs length {len(sample.rollout_log_probs)} != response_length {n}")
    if any(m not in (0, 1) for m in sample.loss_mask):
        raise ValueError("loss_mask holds values other than 0 and 1")
