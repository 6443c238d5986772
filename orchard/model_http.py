"""POST to a model server (an OpenAI-compatible endpoint: a policy's vLLM or SGLang, a
teacher) through transient failures, shared by the rollout policy and the LLM teacher.

Transient: no answer (refused, reset, timed out) and statuses a later identical request may
get past (408, 429, 5xx), retried with exponential backoff or the server's ``Retry-After``;
anything else ends at once. Either way the caller gets :class:`ModelServerGaveUp` with the
last status and the server's own words, and raises its own error type from it.
"""

from __future__ import annotations

import asyncio
import json
import random
from contextlib import nullcontext
from typing import Any, Callable, Optional

import httpx

NO_ANSWER = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class ModelServerGaveUp(Exception):
    """A request that did not succeed: ``status`` None means no answer at all; ``attempts``
    is how many were made (1 for a status no retry can fix)."""

    def __init__(self, status: Optional[int], message: str, attempts: int) -> None:
        super().__init__(message)
        self.status, self.message, self.attempts = status, message, attempts


def transient(status: int) -> bool:
    """Statuses that a later identical request may get past: timeout, rate limit, server trouble."""
    return status in (408, 429) or 500 <= status < 600


def server_message(response: httpx.Response, limit: int = 500) -> str:
    """What the server said: OpenAI's/vLLM's ``error.message``, FastAPI's ``detail``, or the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:limit] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:limit]
        for key in ("message", "detail", "error"):
            if body.get(key):
                value = body[key]
                return (json.dumps(value) if isinstance(value, (dict, list)) else str(value))[:limit]
    return json.dumps(body)[:limit]


def retry_after(response: httpx.Response) -> Optional[float]:
    """The server's ``Retry-After`` in seconds; None when absent or an HTTP date."""
    try:
        return max(float(response.headers["Retry-After"]), 0.0)
    except (KeyError, ValueError):
        return None


async def post_with_retries(http: httpx.AsyncClient, url: str, body: dict[str, Any], *, attempts: int,
                            backoff: float, max_backoff: float, jitter: bool = False,
                            slots: Optional[asyncio.Semaphore] = None,
                            on_request: Optional[Callable[[], None]] = None) -> httpx.Response:
    """The first 2xx answer to ``body`` POSTed to ``url``, at most ``attempts`` tries; the
    n-th retry waits ``backoff * 2**(n-1)`` (times a random 0.5-1 with ``jitter``, which
    spreads a herd of clients) or the server's ``Retry-After``, at most ``max_backoff``."""
    for attempt in range(1, attempts + 1):
        try:
            async with slots if slots is not None else nullcontext():
                if on_request is not None:
                    on_request()
                response = await http.post(url, json=body)
        except NO_ANSWER as exc:
            status, message, wait = None, f"{type(exc).__name__}: {exc}", None
        else:
            if response.is_success:
                return response
            status, message, wait = response.status_code, server_message(response), retry_after(response)
            if not transient(status):
                raise ModelServerGaveUp(status, message, attempt)
        if attempt == attempts:
            raise ModelServerGaveUp(status, message, attempt)
        if wait is None:
            wait = backoff * 2 ** (attempt - 1) * (random.uniform(0.5, 1.0) if jitter else 1.0)
        await asyncio.sleep(min(wait, max_backoff))
    raise ValueError("attempts must be at least 1")
