"""SGLang's native ``/generate`` as an Orchard policy: token ids in, token ids and log-probs out.

slime drives SGLang through its router's ``/generate`` (``slime/rollout/sglang_rollout.py``):
the request carries ``input_ids``, ``sampling_params`` and ``return_logprob``; the answer's
``meta_info.output_token_logprobs`` lists ``[logprob, token_id, text]`` per sampled token and
``meta_info.finish_reason.type`` is ``stop``, ``length`` or ``abort``. Nothing is
re-tokenized: the prompt, each turn's close and each observation come from the served
model's own chat template (:class:`ChatTemplateTokens`), observations with mask 0, and the
next request sends the whole recorded sequence.

An ``abort`` answer (the trainer aborted the request: ``POST /abort_request``, as slime
does once a batch is full, or the engine restarted) raises :class:`GenerationAborted`,
which the rollout loop turns into an ``aborted`` rollout: never a -1. Retries and backoff
on transient HTTP failures are the OpenAI-compatible policy's.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

from orchard.rollout.policies.errors import PolicyError, PolicyResponseError
from orchard.rollout.policies.openai_compat import OpenAICompatiblePolicy
from orchard.rollout.policy import Context, FinishReason, Generation


class GenerationAborted(PolicyError):
    """SGLang answered ``finish_reason: abort``: the request was cut off by the trainer or the engine."""


class SGLangPolicy(OpenAICompatiblePolicy):
    name = "sglang"

    def __init__(self, base_url: str, tokenizer: Any, *, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, sampling_params: Optional[dict[str, Any]] = None, timeout: float = 600.0,
                 retries: int = 4, backoff: float = 1.0, max_concurrency: int = 64,
                 template_kwargs: Optional[dict[str, Any]] = None) -> None:
        """``base_url``: the router (``http://HOST:PORT``); ``sampling_params`` are merged into
        every request's (e.g. slime's ``stop``, ``no_stop_trim``)."""
        extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else None
        super().__init__(base_url, model="sglang", temperature=temperature, top_p=top_p, timeout=timeout,
                         retries=retries, backoff=backoff, token_ids=True, server="sglang", tokenizer=tokenizer,
                         extra_body=extra, max_concurrency=max_concurrency)
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/generate"
        self.top_k = top_k
        self.tokenizer = tokenizer
        self.sampling_params = dict(sampling_params or {})
        self.in_flight: set[str] = set()

    def generate_body(self, tokens: list[int], max_tokens: int, rid: str) -> dict[str, Any]:
        stops = sorted(self.template.stop_ids) if self.template is not None else []
        params = {"max_new_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "stop_token_ids": stops, "skip_special_tokens": False,
                  "no_stop_trim": True, "spaces_between_special_tokens": False, **self.sampling_params}
        return {"input_ids": list(tokens), "sampling_params": params, "return_logprob": True, "rid": rid}

    async def act(self, context: Context, max_tokens: int) -> Generation:
        rid = uuid.uuid4().hex
        self.in_flight.add(rid)
        try:
            answer = await self.complete(self.generate_body(context.tokens, max_tokens, rid))
        finally:
            self.in_flight.discard(rid)
        sampled, logprobs, finish = parse_generate(answer)
        if finish == "abort":
            raise GenerationAborted(f"{self.url}: request {rid} was aborted after {len(sampled)} tokens")
        context.append(sampled, logprobs, trained=True)
        context.append(self.template.close(sampled))  # type: ignore[union-attr]
        text = self.tokenizer.decode(sampled, skip_special_tokens=True)
        context.messages.append({"role": "assistant", "content": text})
        reason: FinishReason = "length" if finish == "length" else "stop"
        return Generation(text, sampled, logprobs, reason)

    async def abort(self, rid: Optional[str] = None) -> None:
        """Abort one request (``rid``) or every request on the server (slime's ``abort_all``)."""
        http, _ = self._client()
        body = {"rid": rid} if rid else {"abort_all": True}
        response = await http.post(self.base_url + "/abort_request", json=body)
        response.raise_for_status()


def parse_generate(answer: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """Sampled ids, their log-probs and the finish type of a ``/generate`` answer."""
    meta = answer.get("meta_info")
    if not isinstance(meta, dict):
        raise PolicyResponseError("the /generate answer has no meta_info")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in ("stop", "length", "abort"):
        raise PolicyResponseError(f"unknown finish_reason {finish!r}: expected type stop, length or abort")
    entries = meta.get("output_token_logprobs")
    if entries is None and kind == "abort":
        return [], [], kind
    if not isinstance(entries, list):
        raise PolicyResponseError("meta_info has no output_token_logprobs: send return_logprob=true")
    try:
        logprobs = [float(entry[0]) for entry in entries]
        ids = [entry[1] for entry in entries]
    except (TypeError, ValueError, IndexError):
        raise PolicyResponseError("an output_token_logprobs entry is not [logprob, token_id, ...]") from None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise PolicyResponseError("output_token_logprobs holds a token id that is not an integer")
    return ids, logprobs, kind
