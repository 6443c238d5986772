"""Running one command in a sandbox: spawn, spool, time out, record.

Each job is spawned with ``posix_spawn`` as the leader of its own session (so a
timeout kills its whole process group), with stdout/stderr going to spool files.
The call returns when the foreground shell exits; background processes it left
keep running until the sandbox dies.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

from orchard.agent.process_marks import MARK, kill_marked, new_mark
from orchard.agent.reaper import ChildReaper
from orchard.agent.runtimes.api import IsolationRuntime
from orchard.agent.sandbox import SandboxState
from orchard.agent.spawner import Spawned, SpawnerLost, SpawnerUnavailable
from orchard.agent.spool import SpoolFile
from orchard.errors import OrchardError
from orchard.models import ExecRequest, Job

log = logging.getLogger(__name__)
POLL_SECONDS = 0.25
FLOOD_POLL_SECONDS = 0.01  # while output pours in, release it often: its pages count against the sandbox
STREAM_POLL_SECONDS = 0.02
TIMEOUT_EXIT_CODE = 124
_TTY_WARNINGS = (
    "bash: cannot set terminal process group",
    "bash: no job control in this shell",
)


@dataclass
class JobRecord:
    job: Job
    request: ExecRequest
    stdout: Optional[SpoolFile] = None
    stderr: Optional[SpoolFile] = None
    pid: Optional[int] = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    finished_at: float = 0.0
    readers: int = 0  # open streams; spool files are released when the last one ends

    def release_spools(self) -> None:
        if self.done.is_set() and self.readers == 0:
            for spool in (self.stdout, self.stderr):
                if spool is not None:
                    spool.close()


_DEV_NULL = -1


def _dev_null() -> int:
    """One read-only /dev/null for every command's stdin (the spawner needs a descriptor)."""
    global _DEV_NULL
    if _DEV_NULL < 0:
        _DEV_NULL = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    return _DEV_NULL


def _killpg(pid: int) -> Callable[[], None]:
    def kill() -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return kill


def shell_argv(shell: str, command: str, login_shell: bool) -> list[str]:
    """How the original runs commands: ``bash -c``, or a login shell that sources ~/.bashrc."""
    if login_shell and shell == "bash":
        return ["bash", "--login", "-i", "-c", f"if [ -f ~/.bashrc ]; then . ~/.bashrc; fi\n{command}"]
    if login_shell:
        return [shell, "-l", "-c", command]
    return [shell, "-c", command]


def strip_tty_warnings(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith(_TTY_WARNINGS))


def process_ended(pid: int) -> bool:
    """True when ``pid`` is gone or a zombie (killed, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


async def settle_holder(sandbox: SandboxState, timeout: float = 2.0, dying: bool = False) -> None:
    """A command killed by a signal may have died with its sandbox's holder, whose own exit
    can be reaped a moment later: wait for it, so the job reads ``sandbox_lost``, not a plain failure.
    ``dying``: the holder's spawner socket closed, which it does while it exits."""
    placement, holder_exit = sandbox.placement, sandbox.holder_exit
    if placement is None or holder_exit is None:
        return
    if not holder_exit.done():
        pid = placement.target_pid or placement.holder_pid
        if not (dying or (pid and process_ended(pid))):
            return
        await asyncio.wait([holder_exit], timeout=timeout)
    # An exit already seen may still have its callback (which marks the sandbox lost) queued:
    # callbacks run in order, so one turn of the loop lets it run first.
    await asyncio.sleep(0)


class JobRunner:
    def __init__(self, reaper: ChildReaper, helper: Path, max_output_bytes: int) -> None:
        self.reaper = reaper
        self.helper = helper
        self.max_output_bytes = max_output_bytes

    async def run(self, sandbox: SandboxState, runtime: IsolationRuntime, record: JobRecord, cwd: str) -> None:
        """Run ``record`` under the sandbox's lock and fill in its result."""
        job = record.job
        try:
            async with sandbox.lock:
                if sandbox.status != "ready":
                    self._fail(record, "sandbox_lost", f"sandbox {sandbox.sandbox_id} is {sandbox.status}")
                    return
                await self._run_locked(sandbox, runtime, record, cwd)
        except OrchardError as exc:  # refused (rejected), or its agent-side cause, typed
            self._fail(record, exc.error_type, exc.message)
        except Exception as exc:  # never leave a caller waiting on a job that cannot finish
            self._fail(record, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            if not job.done:
                self._fail(record, "internal", "job ended without a result")
            record.finished_at = time.monotonic()
            record.done.set()
            record.release_spools()
            spawner = runtime.spawner(sandbox)
            if spawner is not None:  # the next command's process, unless its start already asked for it
                asyncio.get_running_loop().call_soon(spawner.prepare)

    def _fail(self, record: JobRecord, error_type: str, message: str) -> None:
        job = record.job
        job.status, job.error_type, job.error = "failed", error_type, message
        job.completed_at = time.time()

    async def _run_locked(self, sandbox: SandboxState, runtime: IsolationRuntime, record: JobRecord, cwd: str) -> None:
        placement = sandbox.placement
        assert placement is not None
        request, job = record.request, record.job
        job_cgroup: Optional[Path] = None
        command = shell_argv(placement.shell, request.command_text(), request.login_shell)
        mark = new_mark()
        env = {**placement.env, **request.env, MARK: mark}
        stdin_fd = -1
        if request.stdin is not None:
            stdin_fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
            os.write(stdin_fd, request.stdin.encode())
            os.lseek(stdin_fd, 0, os.SEEK_SET)

        def fresh_stdio() -> tuple[int, int, int]:
            """New output files (dropping what a failed start wrote) and the command's stdio;
            made only where used: a prestarted bash comes with its own."""
            for spool in (record.stdout, record.stderr):
                if spool is not None:
                    spool.close()
            record.stdout = SpoolFile("stdout", self.max_output_bytes)
            record.stderr = SpoolFile("stderr", self.max_output_bytes)
            return stdin_fd if stdin_fd >= 0 else _dev_null(), record.stdout.fd, record.stderr.fd

        spawned: Optional[Spawned] = None
        reserved: Optional[Path] = None
        try:
            spawner = runtime.spawner(sandbox)
            if spawner is not None:  # forked by the sandbox's holder: no exec, no setns
                try:
                    plain = (placement.shell == "bash" and not request.login_shell and not request.env
                             and request.stdin is None)  # what a prestarted bash runs as bash -c would
                    spawned = await spawner.spawn(command, env, cwd, fresh_stdio,
                                                  shell_command=request.command_text() if plain else None)
                    job_cgroup = spawned.cgroup
                    if spawned.shell is not None:  # it writes to the files it was started with
                        record.stdout = SpoolFile("stdout", self.max_output_bytes, spawned.shell.stdout)
                        record.stderr = SpoolFile("stderr", self.max_output_bytes, spawned.shell.stderr)
                        mark = spawned.shell.mark
                except SpawnerUnavailable as exc:
                    log.warning("sandbox %s: %s; running the command through orchard-enter", sandbox.sandbox_id, exc)
            if spawned is None:
                fresh_stdio()
            if spawned is not None:
                record.pid = spawned.pid
                exited, kill = spawned.exited, spawned.kill
            else:
                job_cgroup = reserved = sandbox.cgroup.claim_job_dir() if sandbox.cgroup is not None else None
                record.pid = self._spawn_helper(runtime.command(sandbox, command, cwd, job_cgroup), env, record, stdin_fd)
                exited, kill = self.reaper.wait(record.pid), _killpg(record.pid)
            job.status, job.started_at = "running", time.time()
            try:
                exit_code, killed_for = await self._supervise(record, exited, kill)
            except SpawnerLost as exc:
                exit_code, killed_for, lost = -1, None, str(exc)
            else:
                lost = None
            if exit_code > 128 and sandbox.cgroup is not None and sandbox.cgroup.new_oom_kills():
                job.error = "the out-of-memory killer ended a process: the sandbox hit its memory limit"
            if killed_for is not None or lost is not None:  # also what left the process group
                if job_cgroup is not None and sandbox.cgroup is not None:
                    sandbox.cgroup.kill_all(job_cgroup)
                else:
                    kill()
                    await asyncio.to_thread(kill_marked, mark)
                if spawner is not None:  # the next command's waiting process: the job's processes could reach it
                    spawner.drop_prepared()
        finally:
            if sandbox.cgroup is not None:
                sandbox.cgroup.release_job_dir(reserved)
            if stdin_fd >= 0:
                os.close(stdin_fd)
            if spawned is not None:
                spawned.close()
        if (exit_code > 128 and killed_for is None) or lost is not None:
            await settle_holder(sandbox, dying=lost is not None)
        self._record_result(sandbox, record, exit_code, killed_for)
        if lost is not None and job.error_type is None:
            job.status, job.error_type = "failed", "internal"
            job.error = f"the sandbox's spawner lost track of the command ({lost}); it was killed"

    def _spawn_helper(self, argv: list[str], env: dict[str, str], record: JobRecord, stdin_fd: int) -> int:
        """The per-command way: ``orchard-enter`` joins the sandbox and runs the command."""
        assert record.stdout and record.stderr
        stdin_action: tuple = ((os.POSIX_SPAWN_DUP2, stdin_fd, 0) if stdin_fd >= 0
                               else (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0))
        return os.posix_spawn(str(self.helper), argv, env, file_actions=[
            stdin_action,
            (os.POSIX_SPAWN_DUP2, record.stdout.fd, 1),
            (os.POSIX_SPAWN_DUP2, record.stderr.fd, 2),
        ], setsid=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM))

    async def _supervise(self, record: JobRecord, exited: "asyncio.Future[int]",
                         kill: Callable[[], None]) -> tuple[int, Optional[str]]:
        """Wait for the command; kill its process group on timeout or idle timeout."""
        assert record.pid is not None and record.stdout and record.stderr
        request = record.request
        deadline = time.monotonic() + request.effective_timeout()
        last_size, last_change = 0, time.monotonic()
        killed_for: Optional[str] = None
        poll = FLOOD_POLL_SECONDS  # start fast, back off while output stays small
        while not exited.done():
            remaining = deadline - time.monotonic()
            await asyncio.wait([exited], timeout=max(0.0, min(poll, remaining)))
            if exited.done():
                break
            now = time.monotonic()
            size = record.stdout.size() + record.stderr.size()
            flooding = size - last_size > 2 * self.max_output_bytes
            poll = FLOOD_POLL_SECONDS if flooding else min(POLL_SECONDS, poll * 2)
            if size != last_size:
                last_size, last_change = size, now
                for spool in (record.stdout, record.stderr):
                    spool.release_middle()
            if killed_for is None and now >= deadline:
                killed_for = f"command timed out after {request.effective_timeout():g}s"
            elif killed_for is None and request.idle_timeout_seconds and now - last_change >= request.idle_timeout_seconds:
                killed_for = f"command produced no output for {request.idle_timeout_seconds:g}s"
            if killed_for is not None:
                kill()
        return exited.result(), killed_for

    def _record_result(self, sandbox: SandboxState, record: JobRecord, exit_code: int, killed_for: Optional[str]) -> None:
        job = record.job
        assert record.stdout and record.stderr
        out, err = record.stdout.capture(), record.stderr.capture()
        stderr = strip_tty_warnings(err.text) if record.request.login_shell else err.text
        job.stdout, job.stdout_bytes = out.text, out.size
        job.stderr, job.stderr_bytes = stderr, err.size
        job.truncated = out.truncated or err.truncated
        job.completed_at = time.time()
        job.exit_code = exit_code
        if killed_for is not None:
            job.exit_code, job.error_type, job.error = TIMEOUT_EXIT_CODE, "timeout", killed_for
            job.stderr += f"\n[orchard] {killed_for}; killed it and its process group (exit code 124)\n"
        elif sandbox.status == "lost":
            job.error_type, job.error = "sandbox_lost", f"sandbox lost while the command ran: {sandbox.status_message}"
        elif exit_code == 125 and stderr.startswith("orchard-enter:"):
            job.error_type, job.error = "internal", stderr.strip()
        job.status = "succeeded" if job.exit_code == 0 and job.error_type is None else "failed"

    async def stream(self, record: JobRecord) -> AsyncIterator[dict]:
        """Yield output chunks as they come, then ``{"type": "exit", "job": ...}``."""
        record.readers += 1
        try:
            async for event in self._stream(record):
                yield event
        finally:
            record.readers -= 1
            record.release_spools()

    async def _stream(self, record: JobRecord) -> AsyncIterator[dict]:
        if record.done.is_set() and (record.stdout is None or record.stdout.fd < 0):
            for name in ("stdout", "stderr"):  # finished before we came: replay the record
                if getattr(record.job, name):
                    yield {"type": name, "data": getattr(record.job, name)}
            yield {"type": "exit", "job": record.job.model_dump()}
            return
        decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")}
        offsets = {"stdout": 0, "stderr": 0}
        while True:
            finished = record.done.is_set()
            for name in ("stdout", "stderr"):
                spool: Optional[SpoolFile] = getattr(record, name)
                if spool is None or spool.fd < 0:
                    continue
                size = spool.size()
                if size < offsets[name]:  # the command truncated its own output: go on from its end
                    offsets[name] = size
                    decoders[name].reset()
                    yield {"type": name, "data": f"\n[orchard: output truncated to {size} by the command]\n"}
                while offsets[name] < size:
                    keep = spool.limit // 2
                    data_end = size
                    if offsets[name] >= keep and size - offsets[name] > keep:
                        # Past the head and further behind than the tail keeps: the middle is
                        # punched out (or about to be), as the command's result keeps it.
                        skip_to = size - keep
                    else:  # a hole (a punched middle, or a truncate that grew the file) was never written
                        skip_to, data_end = spool.data_from(offsets[name])
                    if skip_to > offsets[name]:
                        offsets[name] = min(skip_to, size)
                        decoders[name].reset()
                        yield {"type": name, "data": f"\n[orchard: output skipped to {offsets[name]}]\n"}
                        continue
                    length = min(max(1, min(data_end, size) - offsets[name]), 1 << 16)  # up to the next hole
                    chunk = spool.read_range(offsets[name], length)
                    if not chunk:
                        break
                    offsets[name] += len(chunk)
                    text = decoders[name].decode(chunk)
                    if text:
                        yield {"type": name, "data": text}
            if finished:
                break
            try:
                await asyncio.wait_for(record.done.wait(), STREAM_POLL_SECONDS)
            except asyncio.TimeoutError:
                pass
        yield {"type": "exit", "job": record.job.model_dump()}
