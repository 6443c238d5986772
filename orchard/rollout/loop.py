"""The multi-turn loop: a policy acting in one sandbox until it submits or runs out.

Each turn the policy writes one action (see :mod:`orchard.rollout.actions`); a command runs
in the task's working directory and its exit code and output come back as the next
observation, cut to ``observation_max_chars`` (head and tail kept). Limits end an episode
as BAR reads it: out of turns or tokens is ``truncated``, out of wall-clock time is
``timed_out``. A lost sandbox (killed holder, cancelled Slurm job, evicted pod) or any other
environment failure is ``aborted``: never a -1, since the policy did nothing wrong.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, TypeVar

from orchard.client.aio import AsyncSandbox
from orchard.errors import OrchardError
from orchard.rollout.actions import SYSTEM_PROMPT, parse_action
from orchard.rollout.policy import Context, Policy
from orchard.rollout.sample import RolloutSample, RolloutStatus, Turn
from orchard.tasks import Task

T = TypeVar("T")


@dataclass
class RolloutConfig:
    """Limits of one episode."""

    max_turns: int = field(default=30, metadata={"help": "assistant turns before the episode is truncated"})
    max_tokens_per_turn: int = field(default=1024, metadata={"help": "tokens one turn may sample"})
    max_total_tokens: int = field(default=16384, metadata={"help": "tokens of the whole sequence (prompt included)"})
    observation_max_chars: int = field(default=8000, metadata={"help": "an observation's length (head and tail "
                                                                       "kept, the middle cut)"})
    command_timeout_seconds: Optional[float] = field(default=None, metadata={
        "help": "one command's budget (default: the task's)"})
    time_limit_seconds: Optional[float] = field(default=None, metadata={
        "help": "the episode's wall-clock budget (default: the task's)"})
    system_prompt: str = field(default=SYSTEM_PROMPT, metadata={"help": "explains the action format"})

    def __post_init__(self) -> None:
        if min(self.max_turns, self.max_tokens_per_turn, self.max_total_tokens, self.observation_max_chars) < 1:
            raise ValueError("max_turns, max_tokens_per_turn, max_total_tokens and observation_max_chars must be >= 1")


def task_messages(task: Task, config: RolloutConfig) -> list[dict[str, str]]:
    return [{"role": "system", "content": config.system_prompt},
            {"role": "user", "content": f"{task.problem_statement.strip()}\n\nThe repository is at {task.workdir} "
                                        "(your working directory). Resolve the issue, then submit."}]


def cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: head and tail kept, the cut said in between."""
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} characters cut ...]\n"
    keep = max(limit - len(marker), 0)
    return text[:keep // 2] + marker + text[len(text) - (keep - keep // 2):]


def observation(job_exit: Optional[int], stdout: str, stderr: str, timed_out: bool, timeout: float,
                limit: int) -> str:
    head = f"The command ran past {timeout:g} s and was killed (exit code 124)." if timed_out \
        else f"exit code: {job_exit}"
    body = stdout + (("\n" if stdout and not stdout.endswith("\n") else "") + stderr if stderr else "")
    return cut(f"{head}\n{body}" if body else head, limit)


class _OutOfTime(Exception):
    pass


async def _within(step: Awaitable[T], left: Callable[[], float]) -> T:
    """``step`` bounded by the episode's remaining time (closed unrun when none is left)."""
    try:
        remaining = left()
    except _OutOfTime:
        if inspect.iscoroutine(step):
            step.close()
        raise
    return await asyncio.wait_for(step, remaining)


async def run_episode(policy: Policy, sandbox: AsyncSandbox, task: Task, config: RolloutConfig,
                      attempt: int = 0) -> RolloutSample:
    """Run one episode of ``task`` in ``sandbox`` (which the caller created and deletes)."""
    start = time.monotonic()
    deadline = start + (config.time_limit_seconds or task.time_limit_seconds)
    command_timeout = config.command_timeout_seconds or task.command_timeout_seconds
    sample = RolloutSample(task_id=task.task_id, attempt=attempt, status=RolloutStatus.TRUNCATED,
                           sandbox_id=sandbox.id)
    context: Optional[Context] = None

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _OutOfTime()
        return remaining

    try:
        context = await _within(policy.begin(task_messages(task, config)), left)
        for _ in range(config.max_turns):
            budget = min(config.max_tokens_per_turn, config.max_total_tokens - policy.tokens_of(context))
            if budget < 1:
                sample.error = f"the sequence reached max_total_tokens ({config.max_total_tokens})"
                break
            began = time.monotonic()
            generation = await _within(policy.act(context, budget), left)
            turn = Turn(text=generation.text, action="invalid", policy_seconds=time.monotonic() - began)
            sample.turns.append(turn)
            action = parse_action(generation.text)
            turn.action, turn.command = action.kind, action.command
            if action.kind == "submit":
                sample.status = RolloutStatus.COMPLETED
                break
            if action.kind == "invalid":
                turn.observation = action.error or "invalid action"
            else:
                timeout = min(command_timeout, left())
                began = time.monotonic()
                job = await sandbox.exec(action.command, timeout=timeout, cwd=task.workdir)
                turn.sandbox_seconds = time.monotonic() - began
                if job.error_type not in (None, "timeout"):  # lost, unreachable, refused: the environment's fault
                    raise _EnvironmentFailed(job.error_type, job.error or job.error_type)
                turn.exit_code = job.exit_code
                turn.observation = observation(job.exit_code, job.stdout, job.stderr, job.error_type == "timeout",
                                               timeout, config.observation_max_chars)
            await _within(policy.observe(context, turn.observation), left)
        else:
            sample.error = f"no submit within max_turns ({config.max_turns})"
    except (_OutOfTime, asyncio.TimeoutError):
        sample.status = RolloutStatus.TIMED_OUT
        sample.error = f"the episode ran past its {deadline - start:g} s"
    except _EnvironmentFailed as exc:
        sample.status, sample.error_type, sample.error = RolloutStatus.ABORTED, exc.kind, exc.message
    except OrchardError as exc:
        sample.status, sample.error_type, sample.error = RolloutStatus.ABORTED, exc.error_type, exc.message
    except Exception as exc:  # a policy server that failed, a broken model: not the policy's choice either
        sample.status, sample.error_type = RolloutStatus.ABORTED, "policy_error"
        sample.error = f"{type(exc).__name__}: {exc}"
    finally:
        if context is not None:
            sample.messages = context.messages
            sample.tokens, sample.logprobs, sample.loss_mask = context.tokens, context.logprobs, context.loss_mask
            sample.prompt_length = context.prompt_length
        sample.policy_seconds = sum(t.policy_seconds for t in sample.turns)
        sample.sandbox_seconds = sum(t.sandbox_seconds for t in sample.turns)
        sample.wall_seconds = time.monotonic() - start
    return sample


class _EnvironmentFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message
