"""Any OpenAI-compatible chat-completions server as a policy: vLLM, SGLang, hosted APIs.

Text mode (default) records messages only: fine for evaluation, refused by trainers.

Token mode (``token_ids=True``) records tokens for training, from what the server says it
did; each turn's request asks for (``server`` picks the field names):

- vLLM (>= 0.10.2): ``logprobs``, ``return_tokens_as_token_ids`` (log-prob entries name
  their token as ``"token_id:123"``) and ``return_token_ids`` (the answer carries the
  prompt's ids as ``prompt_token_ids`` and the sampled ids as ``choices[0].token_ids``).
  Log-probs are raw (before temperature and top-p) under vLLM's default
  ``--logprobs-mode raw_logprobs``; keep that default.
- SGLang: ``logprobs``, ``return_token_ids`` and ``return_prompt_token_ids`` (both id
  lists on the choice). SGLang reports temperature-scaled log-probs unless the server runs
  with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; set it, or sample at temperature 1.

The server re-renders and re-tokenizes the whole conversation each turn, so each turn's
served prompt must extend the tokens recorded so far; the new part (the close of the last
turn, the observation, the generation prompt) is appended with mask 0 and the sampled
tokens with mask 1. A served prompt that does not extend the record raises
:class:`TokenContextMismatch` rather than training on a sequence the model never saw.
With a Hugging Face ``tokenizer`` (the served model's own), the prompt, turn closes and
observations are also rendered here (as in the HF policy), so the record is complete
after each call and every served prompt is checked against it; without one, the tokens
of an observation arrive with the next turn (a final observation leaves none).

Transient failures (HTTP 408, 429, 5xx, connection errors and timeouts) are retried with
exponential backoff, honouring ``Retry-After``; anything else raises
:class:`PolicyServerError` naming the status and the server's message.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal, Optional

import httpx

from orchard.model_http import ModelServerGaveUp, post_with_retries
from orchard.rollout.policies.chat_template import ChatTemplateTokens
from orchard.rollout.policies.errors import PolicyResponseError, PolicyServerError, TokenContextMismatch
from orchard.rollout.policy import Context, FinishReason, Generation, Policy

TOKEN_FIELDS: dict[str, dict[str, bool]] = {
    "vllm": {"logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True},
    "sglang": {"logprobs": True, "return_token_ids": True, "return_prompt_token_ids": True},
}
MAX_BACKOFF = 30.0


class OpenAICompatiblePolicy(Policy):
    name = "openai"

    def __init__(self, base_url: str, model: str, api_key: Optional[str] = None, *, temperature: float = 1.0,
                 top_p: float = 1.0, timeout: float = 600.0, retries: int = 4, backoff: float = 1.0,
                 token_ids: bool = False, server: Literal["vllm", "sglang"] = "vllm", tokenizer: Any = None,
                 seed: Optional[int] = None, extra_body: Optional[dict[str, Any]] = None,
                 max_concurrency: int = 64) -> None:
        """``base_url`` ends where ``/chat/completions`` is appended (usually ``.../v1``);
        ``extra_body`` is merged into every request (e.g. ``top_k``, ``chat_template_kwargs``)."""
        if server not in TOKEN_FIELDS:
            raise ValueError(f"unknown server {server!r}: expected one of {sorted(TOKEN_FIELDS)}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.token_ids = token_ids
        self.server = server
        self.extra_body = dict(extra_body or {})
        self.template = None  # renders like the server: same tokenizer, same chat_template_kwargs
        if token_ids and tokenizer is not None:
            self.template = ChatTemplateTokens(tokenizer, template_kwargs=self.extra_body.get("chat_template_kwargs"))
        self.max_concurrency = max_concurrency
        self._http: Optional[httpx.AsyncClient] = None
        self._slots: Optional[asyncio.Semaphore] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def begin(self, messages: list[dict[str, str]]) -> Context:
        context = Context(messages=[dict(m) for m in messages])
        if self.template is not None:
            context.append(self.template.prompt(messages))
            context.prompt_length = len(context.tokens)
        return context

    async def act(self, context: Context, max_tokens: int) -> Generation:
        answer = await self.complete(self.request_body(context.messages, max_tokens))
        choice = _first_choice(answer)
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
        text = text if isinstance(text, str) else ""
        finish: FinishReason = "length" if choice.get("finish_reason") == "length" else "stop"
        generation = Generation(text=text, finish_reason=finish)
        if self.token_ids:
            sampled, logprobs = _sampled_tokens(choice)
            self._extend_to_served_prompt(context, answer.get("prompt_token_ids") or choice.get("prompt_token_ids"))
            context.append(sampled, logprobs, trained=True)
            if self.template is not None:
                context.append(self.template.close(sampled))
            generation = Generation(text, sampled, logprobs, finish)
        context.messages.append({"role": "assistant", "content": text})
        return generation

    async def observe(self, context: Context, text: str) -> None:
        context.messages.append({"role": "user", "content": text})
        if self.template is not None:
            context.append(self.template.observation(text))

    def request_body(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.token_ids:
            body.update(TOKEN_FIELDS[self.server])
        body.update(self.extra_body)
        return body

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST one chat completion, retrying transient failures; the answer's JSON object."""
        http, slots = self._client()
        try:
            response = await post_with_retries(http, self.url, body, attempts=self.retries + 1, backoff=self.backoff,
                                               max_backoff=MAX_BACKOFF, slots=slots)
        except ModelServerGaveUp as exc:
            raise PolicyServerError(exc.status, exc.message, url=self.url, attempts=exc.attempts) from None
        return _json_object(response)

    def _client(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        """One client per event loop (an httpx client's connections belong to the loop that made them)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._slots is None or self._loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._http = httpx.AsyncClient(timeout=self.timeout, headers=headers, limits=httpx.Limits(
                max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency))
            self._slots, self._loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._http, self._slots

    async def close(self) -> None:
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http = None

    def _extend_to_served_prompt(self, context: Context, served: Any) -> None:
        if served is None:
            if self.template is None:
                raise PolicyResponseError(
                    f"{self.url} returned no prompt_token_ids: token mode needs a server that honours "
                    f"{sorted(TOKEN_FIELDS[self.server])} (server={self.server!r}), or a tokenizer")
            return  # the context was rendered here; nothing to check it against
        if not isinstance(served, list) or not all(isinstance(t, int) for t in served):
            raise PolicyResponseError("prompt_token_ids is not a list of integers")
        recorded = context.tokens
        if served[:len(recorded)] != recorded:
            index = next((i for i, (a, b) in enumerate(zip(recorded, served)) if a != b), len(served))
            raise TokenContextMismatch(index, recorded, served)
        first_turn = not any(m["role"] == "assistant" for m in context.messages)
        context.append(served[len(recorded):])
        if first_turn:
            context.prompt_length = len(context.tokens)


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        answer = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PolicyResponseError(f"the server answered 200 with invalid JSON ({exc}): {response.text[:200]!r}") from None
    if not isinstance(answer, dict):
        raise PolicyResponseError(f"the server answered 200 with JSON that is not an object: {response.text[:200]!r}")
    return answer


def _first_choice(answer: dict[str, Any]) -> dict[str, Any]:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PolicyResponseError(f"the answer has no choices: {json.dumps(answer)[:200]}")
    return choices[0]


def _sampled_tokens(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The sampled ids and their log-probs; the ids from ``token_ids`` or ``"token_id:N"`` entries."""
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list):
        raise PolicyResponseError("the answer has no logprobs.content: token mode needs a server that returns logprobs")
    try:
        logprobs = [float(entry["logprob"]) for entry in content]
    except (KeyError, TypeError, ValueError):
        raise PolicyResponseError("a logprobs.content entry has no numeric logprob") from None
    ids = choice.get("token_ids")
    if ids is None:
        ids = [_token_id(entry.get("token")) for entry in content]
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise PolicyResponseError("token_ids is not a list of integers")
    if len(ids) != len(logprobs):
        raise PolicyResponseError(f"{len(ids)} sampled token ids but {len(logprobs)} log-probs")
    return ids, logprobs


def _token_id(token: Any) -> int:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            pass
    raise PolicyResponseError(f"log-prob token {token!r} is not 'token_id:N': the server ignored "
                              "return_tokens_as_token_ids and returned no token_ids")


