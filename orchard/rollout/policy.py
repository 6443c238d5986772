"""What a policy is to the rollout loop: something that extends a conversation.

The loop never tokenizes. A :class:`Policy` owns a :class:`Context` per rollout: it opens
one from the task's messages (``begin``), extends it with one assistant turn (``act``) and
appends an observation (``observe``). A policy that sees tokens (a Hugging Face model in
process, a vLLM/SGLang server that returns token ids) records in the context exactly the
token ids it sampled with their log-probs and loss mask 1, and the tokens of everything
else (prompt, observations, template glue) with mask 0, so a trainer never re-tokenizes
text and never trains on what it did not sample. A policy that only sees text (a hosted
API) leaves ``tokens`` empty: fine for evaluation, refused by trainers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    """One assistant turn as sampled."""

    text: str
    token_ids: list[int] = field(default_factory=list)  # sampled tokens (empty: the policy sees no tokens)
    logprobs: list[float] = field(default_factory=list)  # log-prob of each sampled token under the sampler
    finish_reason: FinishReason = "stop"  # "length": hit max_tokens


@dataclass
class Context:
    """A rollout's conversation as messages and, for token-level policies, as tokens.

    ``tokens``, ``logprobs`` and ``loss_mask`` have one entry per token of the whole
    sequence (prompt included); ``logprobs`` is 0.0 and ``loss_mask`` 0 where the policy did
    not sample the token. ``prompt_length`` is the number of tokens before the first turn.
    """

    messages: list[dict[str, str]]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    prompt_length: int = 0
    state: Any = None  # the policy's own (e.g. a KV cache handle); never serialized
    # Who this rollout is ("TASK_ID/ATTEMPT"), set by the rollout loop after ``begin``. A policy
    # that draws at random can key its draws to it, so that a rollout's draws do not depend on
    # which rollouts ran beside it or finished first ("" outside the loop).
    rollout: str = ""

    @property
    def tokenized(self) -> bool:
        return bool(self.tokens)

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    def append(self, token_ids: list[int], logprobs: Optional[list[float]] = None, trained: bool = False) -> None:
        """Add tokens: sampled ones (``trained``, with their log-probs) or context (mask 0)."""
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError("one log-prob per token")
        self.tokens += token_ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(token_ids)
        self.loss_mask += [1 if trained else 0] * len(token_ids)


class Policy(ABC):
    """A model the rollout loop can act with (one object serves many rollouts at once)."""

    name: str = "policy"

    @abstractmethod
    async def begin(self, messages: list[dict[str, str]]) -> Context:
        """A new context for a rollout that starts with ``messages`` (system, user)."""

    @abstractmethod
    async def act(self, context: Context, max_tokens: int) -> Generation:
        """Sample the next assistant turn (at most ``max_tokens`` tokens) and append it to
        ``context`` (its message, and its tokens with mask 1 when the policy sees tokens)."""

    @abstractmethod
    async def observe(self, context: Context, text: str) -> None:
        """Append an observation (what the sandbox answered) as the next user message,
        with its tokens (mask 0) when the policy sees tokens."""

    def tokens_of(self, context: Context) -> int:
        """How long the context is in tokens (an estimate for text-only policies)."""
        if context.tokenized:
            return len(context.tokens)
        return sum(len(m["content"]) for m in context.messages) // 4

    def state_dict(self) -> Any:
        """What a trainer's checkpoint keeps of this policy (its sampling RNG), or None."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore what ``state_dict`` gave."""

    async def close(self) -> None:
        """Release clients and models."""
