"""An LLM as a retrospective value function, over any OpenAI-compatible chat endpoint
(vLLM, SGLang, hosted APIs).

The prompt (``PROMPT_TEMPLATE``) shows the task, the numbered steps and, when asked,
the known outcome, and asks for ``{"values": [v0, ..., vT]}``. Answers are parsed
strictly: T + 1 numbers in [0, 1] or the answer is malformed; malformed answers are
retried and then reported as :class:`TeacherError`, never silently read as zeros.
Calls are bounded in concurrency and cached by prompt.

HTTP failures that may pass (no connection, a timeout, 408, 429, 5xx) are retried with
exponential backoff and jitter (or the server's ``Retry-After``), a bounded number of
times; any other status, and the last transient one, is a :class:`TeacherHTTPError`
naming the status and the server's message.

The answer cache is keyed by model, temperature, system prompt and rendered prompt, so a
changed prompt never reads old answers. Several teachers (an ensemble) may share one cache
file: each writes only what it added, merged into the file as it is on disk at that moment
under an exclusive lock and replaced atomically, so no teacher loses another's answers.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import httpx

from orchard.errors import OrchardError
from orchard.model_http import ModelServerGaveUp, post_with_retries, transient
from orchard.train.credit import Trajectory, ValueEstimator

SYSTEM_PROMPT = (
    "You are a retrospective value function for software-engineering agents. You judge, step by step, "
    "how likely an agent's attempt is to end with the task resolved.")

PROMPT_TEMPLATE = """Task:
{task}

The agent's steps (action, then what it observed):
{steps}
{outcome}
For t = 0..{last}, estimate v_t: the probability that the task ends resolved, judged from the history up to
and including step t (v_0: before any action). Reply with only a JSON object: {{"values": [v_0, ..., v_{last}]}}
with exactly {count} numbers between 0 and 1."""

OUTCOMES = {True: "\nThe attempt finally RESOLVED the task.\n", False: "\nThe attempt finally did NOT resolve the task.\n"}


class TeacherError(OrchardError, RuntimeError):
    """The teacher gave no usable answer after its retries."""


class TeacherHTTPError(TeacherError):
    """The teacher's endpoint refused the request, or stayed unreachable or failing for all
    the attempts; ``status`` is the last HTTP status (None: no response at all)."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


def render_prompt(trajectory: Trajectory, with_outcome: bool, max_chars: int = 2000) -> str:
    steps = "\n".join(f"[{i + 1}] action: {s.action[:max_chars]}\n    observation: {s.observation[:max_chars]}"
                      for i, s in enumerate(trajectory.steps))
    count = len(trajectory.steps) + 1
    return PROMPT_TEMPLATE.format(task=trajectory.task[:max_chars * 2], steps=steps or "(none)", last=count - 1,
                                  count=count, outcome=OUTCOMES[trajectory.resolved] if with_outcome else "\n")


def parse_values(content: str, expected: int) -> list[float]:
    """The values of an answer, or ValueError saying what is wrong with it."""
    match = re.search(r"\{.*\}", content, re.DOTALL)
    if not match:
        raise ValueError("no JSON object in the answer")
    try:
        data = json.loads(match.group(0))
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    values = data.get("values") if isinstance(data, dict) else None
    if not isinstance(values, list) or len(values) != expected:
        raise ValueError(f"expected 'values' with {expected} numbers, got {values!r:.200}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 for v in values):
        raise ValueError("values must be numbers between 0 and 1")
    return [float(v) for v in values]


class LLMTeacher(ValueEstimator):
    """``retries``: further asks after a malformed answer; ``http_attempts``: tries of one
    request through transient HTTP failures, ``backoff`` seconds before the second, doubling
    up to ``max_backoff``."""

    def __init__(self, base_url: str, model: str, api_key: Optional[str] = None, *, concurrency: int = 8,
                 retries: int = 2, temperature: float = 0.0, timeout: float = 120.0,
                 cache_path: Optional[Path] = None, http_attempts: int = 5, backoff: float = 1.0,
                 max_backoff: float = 60.0) -> None:
        if http_attempts < 1:
            raise ValueError("http_attempts must be at least 1")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.retries = retries
        self.temperature = temperature
        self.http_attempts = http_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.slots = asyncio.Semaphore(concurrency)
        self.http = httpx.AsyncClient(timeout=timeout, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.cache_path = cache_path
        self.cache: dict[str, list[float]] = _read_cache(cache_path) if cache_path is not None else {}
        self.added: dict[str, list[float]] = {}  # what this teacher asked for: all it writes back
        self.calls = 0  # HTTP requests sent, failed ones included

    async def close(self) -> None:
        await self.http.aclose()
        self.save_cache()

    def save_cache(self) -> None:
        """Merge this teacher's new answers into the cache file, keeping everyone else's."""
        if self.cache_path is None or not self.added:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.cache_path.with_name(self.cache_path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = _read_cache(self.cache_path)
            merged.update(self.added)
            partial = self.cache_path.with_name(f"{self.cache_path.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(merged))
            os.replace(partial, self.cache_path)
        self.added = {}

    async def _post(self, body: dict) -> httpx.Response:
        """One request through transient failures; TeacherHTTPError on the others or at the end."""
        url = f"{self.base_url}/chat/completions"

        def counted() -> None:
            self.calls += 1

        try:
            return await post_with_retries(self.http, url, body, attempts=self.http_attempts, backoff=self.backoff,
                                           max_backoff=self.max_backoff, jitter=True, slots=self.slots,
                                           on_request=counted)
        except ModelServerGaveUp as exc:
            problem = exc.message if exc.status is None else f"HTTP {exc.status}: {exc.message}"
            if exc.status is not None and not transient(exc.status):
                raise TeacherHTTPError(f"teacher {self.model} at {url}: {problem}", exc.status) from None
            raise TeacherHTTPError(f"teacher {self.model} at {url} failed {exc.attempts} attempts; "
                                   f"last: {problem}", exc.status) from None

    async def _ask(self, prompt: str) -> str:
        body: dict[str, Any] = {"model": self.model, "temperature": self.temperature, "messages": [
            {"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]}
        response = await self._post(body)
        try:
            return response.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, LookupError, TypeError):
            raise TeacherError(f"teacher {self.model} at {self.base_url}: not a chat completion: "
                               f"{response.text[:200]!r}") from None

    async def values(self, trajectory: Trajectory, with_outcome: bool = True) -> list[float]:
        prompt = render_prompt(trajectory, with_outcome)
        key = hashlib.sha256(f"{self.model}\0{self.temperature}\0{SYSTEM_PROMPT}\0{prompt}".encode()).hexdigest()
        if key in self.cache:
            return list(self.cache[key])
        problems = []
        for _ in range(self.retries + 1):
            content = await self._ask(prompt)
            try:
                values = parse_values(content, len(trajectory.steps) + 1)
            except ValueError as exc:
                problems.append(f"{exc} (answer began {content[:80]!r})")
                continue
            self.cache[key] = self.added[key] = values
            return values
        raise TeacherError(f"{self.model} gave no usable values for {trajectory.task_id} after "
                           f"{self.retries + 1} tries: " + "; ".join(problems))


def _read_cache(path: Path) -> dict[str, list[float]]:
    """The cache file's answers; a missing file is an empty cache."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
