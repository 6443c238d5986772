"""Credit-assigned SFT data for slime: ``--rollout-function-path ...generate_sft_rollout``.

``orchard credit`` writes examples whose ``messages`` carry a per-message ``loss_mask``
(all actions of resolved trajectories, the ascending segments of failed ones). slime reads
that JSONL as prompt data (``--input-key messages``, no ``--apply-chat-template``: the
messages reach the rollout function as they are) and trains with ``--loss-type sft_loss``.
Its own ``sft_rollout`` masks every assistant turn; this one tokenizes with Orchard's
:func:`~orchard.train.sft_data.tokenize_example`, so only the credited actions (their
content and the token ending them) have mask 1, exactly as the standalone SFT trainer
trains. As slime's SFT does, the response starts at the first trained token:
``tokens`` is the whole example, ``loss_mask`` its last ``response_length`` entries.
"""

from __future__ import annotations

from typing import Any, Optional

from orchard.integrations.slime.rollout import train_output
from orchard.integrations.slime.runtime import load_tokenizer
from orchard.integrations.slime.samples import check_sample, sample_class
from orchard.integrations.slime.settings import SlimeSettings
from orchard.train.sft_data import tokenize_example

_TOKENIZERS: dict[str, Any] = {}


def sft_sample(messages: list[dict], tokenizer: Any, max_length: int, sample: Any = None) -> Any:
    """``sample`` (or a new slime ``Sample``) holding one example with per-token loss mask."""
    example = tokenize_example(tokenizer, messages, max_length)
    if 1 not in example.loss_mask:
        raise ValueError("the example trains no token (no assistant message with loss_mask 1 survived max_length)")
    start = example.loss_mask.index(1)
    sample = sample if sample is not None else sample_class()()
    cls = type(sample)
    sample.prompt = messages
    sample.tokens = list(example.input_ids)
    sample.response_length = len(example.input_ids) - start
    sample.loss_mask = list(example.loss_mask[start:])
    sample.rollout_log_probs = None
    sample.reward = 0.0
    sample.status = cls.Status.COMPLETED
    sample.metadata = {**(sample.metadata or {}), "orchard_sft": {"dropped_messages": example.dropped_messages}}
    check_sample(sample)
    return sample


def max_length(args: Any, settings: Optional[SlimeSettings] = None) -> int:
    settings = settings or SlimeSettings.load()
    for value in (settings.sft_max_length, getattr(args, "seq_length", None),
                  getattr(args, "rollout_max_context_len", None)):
        if value:
            return int(value)
    raise ValueError("no SFT length: set sft_max_length in the Orchard slime settings or slime's --seq-length")


def generate_sft_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False,
                         tokenizer: Any = None) -> Any:
    """slime's rollout function for SFT: ``--rollout-batch-size`` examples, tokenized and masked."""
    if evaluation:
        raise ValueError("generate_sft_rollout has no evaluation: leave --eval-function-path to another function")
    if tokenizer is None:
        key = str(args.hf_checkpoint)
        tokenizer = _TOKENIZERS.get(key) or _TOKENIZERS.setdefault(key, load_tokenizer(args))
    length = max_length(args)
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            if not isinstance(sample.prompt, list):
                raise ValueError("an SFT row's prompt must be its messages: run slime with --input-key messages "
                                 "and without --apply-chat-template")
            sft_sample(sample.prompt, tokenizer, length, sample)
    return train_output(groups)
