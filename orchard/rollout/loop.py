"""The multi-turn loop: a policy acting in one sandbox until it submits or runs out.

Each turn the policy writes one action (see :mod:`orchard.rollout.actions`); a command runs
in the task's working directory and its exit code and output come back as the next
observation, cut to ``observation_max_chars`` (head and tail kept). Limits end an episode
as BAR reads it: out of turns or tokens is ``truncated``, out of wall-clock time is
``timed_out``. A lost sandbox (killed holder, cancelled Slurm job, evicted pod) or any other
environment failure is ``aborted``: never a -1, since the policy did nothing wrong.

Whatever the *action* causes is the policy's doing, so it is an observation and the episode
goes on: a command that cannot be sent (past :data:`MAX_COMMAND_BYTES`, a NUL byte, a lone
surrogate), one the sandbox refuses, and a working directory the policy removed (later
commands run in ``/`` until it exists again, and the observation says so). Otherwise a policy
could turn its own failure into ``aborted``, which earns no -1 and leaves evaluation's n.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, TypeVar

from orchard.client.aio import AsyncSandbox
from orchard.errors import InvalidRequest, OrchardError, PayloadTooLarge
from orchard.models import ExecRequest, Job
from orchard.rollout.actions import SYSTEM_PROMPT, parse_action
from orchard.rollout.policy import Context, Policy
from orchard.rollout.sample import RolloutSample, RolloutStatus, Turn
from orchard.tasks import Task

T = TypeVar("T")
log = logging.getLogger("orchard.rollout")

# One argument of a command may hold 128 KiB on Linux (MAX_ARG_STRLEN), and a command goes as
# one: past it the exec fails inside the service (E2BIG). This leaves room for the wrapping.
MAX_COMMAND_BYTES = 100_000
MAX_EXEC_TIMEOUT = float(next(m.le for m in ExecRequest.model_fields["timeout_seconds"].metadata
                              if hasattr(m, "le")))  # the exec API's limit on one command (7 days)
_clamped: set[str] = set()  # tasks whose command timeout was said to be clamped


def exec_timeout(seconds: float, task_id: str) -> float:
    """``seconds`` within what the exec API takes for one command (said once per task when cut)."""
    if seconds <= MAX_EXEC_TIMEOUT:
        return seconds
    if task_id not in _clamped:
        _clamped.add(task_id)
        log.warning("task %s: a command timeout of %g s is past the exec API's limit; its commands get %g s",
                    task_id, seconds, MAX_EXEC_TIMEOUT)
    return MAX_EXEC_TIMEOUT


def command_problem(command: str) -> Optional[str]:
    """Why ``command`` cannot be sent at all (the observation; nothing ran), or None."""
    if "\0" in command:
        return "The command contains a NUL byte; nothing ran. Write NUL with printf '\\0' instead."
    try:
        size = len(command.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return f"The command is not valid text (a lone surrogate at character {exc.start}); nothing ran."
    if size > MAX_COMMAND_BYTES:
        return (f"The command is {size} bytes long, past the limit of {MAX_COMMAND_BYTES} bytes; nothing ran. "
                "Write long text in several smaller commands (append to a file with cat >> FILE <<'EOF').")
    return None


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
    submit_required: bool = field(default=False, metadata={
        "help": "an episode that never submits (truncated) earns -1 whatever its diff: with a reward for the final "
                "state alone, RL has no reason to stop once the fix is in, and reinforces whatever follows it"})

    def __post_init__(self) -> None:
        if min(self.max_turns, self.max_tokens_per_turn, self.max_total_tokens, self.observation_max_chars) < 1:
            raise ValueError("max_turns, max_tokens_per_turn, max_total_tokens and observation_max_chars must be >= 1")
        if any(seconds is not None and not seconds > 0 for seconds in (self.command_timeout_seconds,
                                                                       self.time_limit_seconds)):
            raise ValueError("command_timeout_seconds and time_limit_seconds must be > 0 (or unset: the task's)")


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
    command_timeout = exec_timeout(config.command_timeout_seconds or task.command_timeout_seconds, task.task_id)
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
        context.rollout = f"{task.task_id}/{attempt}"
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
                turn.exit_code, turn.observation = await _command(sandbox, action.command, task.workdir, timeout,
                                                                  config.observation_max_chars)
                turn.sandbox_seconds = time.monotonic() - began
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


async def _command(sandbox: AsyncSandbox, command: str, workdir: str, timeout: float,
                   limit: int) -> tuple[Optional[int], str]:
    """Run one of the policy's commands: its exit code and the observation. What the command
    itself caused comes back as the observation; the environment's failures raise."""
    problem = command_problem(command)
    if problem is not None:
        return None, problem
    note = ""
    job = await _exec(sandbox, command, timeout, workdir)
    if isinstance(job, str) and not await _is_directory(sandbox, workdir):
        note = f"The working directory {workdir} does not exist (any more); the command ran in /.\n"
        job = await _exec(sandbox, command, timeout, "/")
    if isinstance(job, str):
        return None, cut(f"{note}The command was refused; nothing ran: {job}", limit)
    if job.error_type == "rejected":  # refused once queued (what it asked for, not the sandbox's state)
        return job.exit_code, cut(f"{note}The command was refused: {job.error}", limit)
    if job.error_type == "internal" and job.exit_code == 125 and await _runs(sandbox):
        # The service reads exit 125 with "orchard-enter:" on stderr as its own failure, and a
        # command can print that too; a sandbox that still runs a command failed at nothing.
        job.error_type = None
    if job.error_type not in (None, "timeout"):  # lost, unreachable, internal: the environment's fault
        raise _EnvironmentFailed(job.error_type, job.error or job.error_type)
    return job.exit_code, note + observation(job.exit_code, job.stdout, job.stderr, job.error_type == "timeout",
                                             timeout, max(limit - len(note), 1))


async def _exec(sandbox: AsyncSandbox, command: str, timeout: float, cwd: str) -> Job | str:
    """The job, or why the request was refused (nothing ran)."""
    try:
        return await sandbox.exec(command, timeout=timeout, cwd=cwd)
    except (InvalidRequest, PayloadTooLarge) as exc:
        return exc.message


async def _runs(sandbox: AsyncSandbox) -> bool:
    job = await sandbox.exec("true", cwd="/", timeout=60)
    return job.ok


async def _is_directory(sandbox: AsyncSandbox, path: str) -> bool:
    job = await sandbox.exec(["test", "-d", path], cwd="/", timeout=60)
    if job.error_type not in (None, "timeout"):
        raise _EnvironmentFailed(job.error_type, job.error or job.error_type)
    return job.exit_code == 0


class _EnvironmentFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message
