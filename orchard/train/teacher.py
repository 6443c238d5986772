"""An LLM as a retrospective value function, over any OpenAI-compatible chat endpoint
(vLLM, SGLang, hosted APIs).

The prompt (``PROMPT_TEMPLATE``) shows the task, the numbered steps and, when asked,
the known outcome, and asks for ``{"values": [v0, ..., vT]}``. Answers are parsed
strictly: T + 1 numbers in [0, 1] or the answer is malformed; malformed answers are
retried and then reported as :class:`TeacherError`, never silently read as zeros.
Calls are bounded in concurrency and cached by prompt.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Optional

import httpx

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


class TeacherError(RuntimeError):
    """The teacher gave no usable answer after its retries."""


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
    def __init__(self, base_url: str, model: str, api_key: Optional[str] = None, *, concurrency: int = 8,
                 retries: int = 2, temperature: float = 0.0, timeout: float = 120.0,
                 cache_path: Optional[Path] = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.retries = retries
        self.temperature = temperature
        self.slots = asyncio.Semaphore(concurrency)
        self.http = httpx.AsyncClient(timeout=timeout, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.cache_path = cache_path
        self.cache: dict[str, list[float]] = {}
        if cache_path is not None and cache_path.exists():
            self.cache = json.loads(cache_path.read_text())
        self.calls = 0

    async def close(self) -> None:
        await self.http.aclose()
        if self.cache_path is not None:
            self.cache_path.write_text(json.dumps(self.cache))

    async def _ask(self, prompt: str) -> str:
        body: dict[str, Any] = {"model": self.model, "temperature": self.temperature, "messages": [
            {"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]}
        async with self.slots:
            self.calls += 1
            response = await self.http.post(f"{self.base_url}/chat/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"] or ""

    async def values(self, trajectory: Trajectory, with_outcome: bool = True) -> list[float]:
        prompt = render_prompt(trajectory, with_outcome)
        key = hashlib.sha256(f"{self.model}\0{self.temperature}\0{prompt}".encode()).hexdigest()
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
            self.cache[key] = values
            return values
        raise TeacherError(f"{self.model} gave no usable values for {trajectory.task_id} after "
                           f"{self.retries + 1} tries: " + "; ".join(problems))
