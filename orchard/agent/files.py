"""File calls (upload, download, list) done from inside the sandbox, never by the agent.

Each call runs ``orchard-enter --file`` through the sandbox's runtime, exactly like a
command: it joins the sandbox's namespaces and cgroup, chroots into its root and drops to
the sandbox user with no capabilities before it touches a path (see ``enter_files.c``).
So a symlink planted to ``/proc/sys/...`` reaches only what the sandbox user could reach
with a shell, special files are refused without blocking, and uploaded bytes are charged
to the sandbox's memory and disk limits. The agent only moves bytes through sockets, so no
file work runs on (or can block) its event loop.

Sockets, not pipes: uvloop closes a pipe transport's descriptor itself and then closes the
file object it was given too, a second close(2) of the same number. A descriptor that
another thread (a ``to_thread`` call) opened in between was closed under it: commands then
failed with EBADF or ESPIPE and uvloop refused a reused number (EEXIST). A socket it detaches.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Optional, TypeVar

from orchard.agent.jobs import settle_holder
from orchard.download_cut import DownloadCut
from orchard.errors import FileOperationFailed, PayloadTooLarge, RuntimeUnavailable, SandboxLost, SandboxNotReady
from orchard.models import FileEntry

if TYPE_CHECKING:
    from orchard.agent.reaper import ChildReaper
    from orchard.agent.runtimes.api import IsolationRuntime
    from orchard.agent.sandbox import Placement, SandboxState

log = logging.getLogger("orchard.agent")

FILE_ERROR_EXIT = 3  # enter_files.c: the operation failed, the reason is on stderr
HELPER_FAILED_EXIT = 125
HELPER_CHECK_SECONDS = 1.0  # how often a waiting file call looks at its helper
T = TypeVar("T")
_KINDS = {"d": "directory", "f": "file", "l": "symlink", "o": "other"}
_REASONS = {
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EISDIR: "is a directory",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left (disk quota of the sandbox)",
    errno.EDQUOT: "disk quota of the sandbox exceeded",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENXIO: "not a regular file",
    errno.ENAMETOOLONG: "file name too long",
}


class _HelperRun:
    """One ``orchard-enter --file`` process: its pipes and its exit.

    The helper runs as the sandbox's user in its PID namespace, so the sandbox can stop it
    (SIGSTOP) or starve it, and a call waiting on it would hold its slots, and the agent's,
    for good: one sandbox held every slot of an agent with max_file_calls 16 and blocked
    another's download. So every wait on a helper (``within``) checks it once a second,
    kills one found stopped at once, and one that made no progress for ``stall`` seconds."""

    def __init__(self, pid: int, exited: "asyncio.Future[int]", stdout: asyncio.StreamReader,
                 stdout_end: asyncio.StreamWriter, stdin: Optional[asyncio.StreamWriter], stderr_fd: int,
                 stall: float) -> None:
        self.pid, self.exited, self.stdout, self.stdin, self.stderr_fd = pid, exited, stdout, stdin, stderr_fd
        self.stdout_end = stdout_end  # owns the socket (a stream keeps it open after EOF)
        self.stall = stall

    async def within(self, step: Awaitable[T]) -> T:
        """``step`` (a read, a drain, the exit), or FileOperationFailed once the helper is
        found stopped or ``stall`` seconds pass without it completing; the helper is killed."""
        # a future (the exit) is shared with the reaper: waited on through a shield, never cancelled
        task = asyncio.ensure_future(step if asyncio.iscoroutine(step) else asyncio.shield(step))
        waited = 0.0
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=HELPER_CHECK_SECONDS)
                if done:
                    return task.result()
                waited += HELPER_CHECK_SECONDS
                stopped = self.stopped()
                if stopped or waited >= self.stall:
                    self.kill()
                    why = "was stopped inside the sandbox" if stopped else f"made no progress for {self.stall:g} s"
                    raise FileOperationFailed(f"the file call's helper {why}; it was killed (file_call_stall_seconds)")
        finally:
            if not task.done():
                task.cancel()

    def stopped(self) -> bool:
        """Whether the helper, or the child it forked into the sandbox's PID namespace (the
        one the sandbox sees), is stopped: SIGSTOP, SIGTSTP or a tracer's stop. Killing the
        helper kills that child (its parent-death signal)."""
        pids = [self.pid]
        try:
            for task in os.listdir(f"/proc/{self.pid}/task"):
                with open(f"/proc/{self.pid}/task/{task}/children", "rb") as children:
                    pids += [int(child) for child in children.read().split()]
        except OSError:
            pass
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as stat_file:
                    if stat_file.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t"):
                        return True
            except (OSError, IndexError):
                continue
        return False

    def stderr(self) -> str:
        return os.pread(self.stderr_fd, 4096, 0).decode(errors="replace")

    def kill(self) -> None:
        if not self.exited.done():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.stdout_end.close()
        if self.stdin is not None:
            self.stdin.close()
        if self.stderr_fd >= 0:
            os.close(self.stderr_fd)
            self.stderr_fd = -1


def _close_ours(out_ours: socket.socket, in_ours: Optional[socket.socket], err_fd: int) -> None:
    """The agent's ends of a helper run that never got going."""
    for ours in (out_ours, in_ours):
        if ours is not None:
            ours.close()
    os.close(err_fd)


class _ReadStream:
    """A download's bytes as the helper reads them. The helper and the slots are freed when
    the stream ends, fails, is closed, or is dropped unread (a response never sent): an
    async generator that never started would run no cleanup at all and keep them."""

    def __init__(self, files: "SandboxFiles", run: _HelperRun, full: str) -> None:
        self.files, self.run, self.full = files, run, full
        self.loop = asyncio.get_running_loop()
        self.done = False

    def __aiter__(self) -> "_ReadStream":
        return self

    async def __anext__(self) -> bytes:
        if self.done:
            raise StopAsyncIteration
        try:
            chunk = await self.run.within(self.run.stdout.read(1 << 20))
            if self.done:  # closed while this read waited
                raise StopAsyncIteration
            if chunk:
                return chunk
            if await self.run.within(self.run.exited) != 0 and not self.done:
                failure = await self.files._failure(self.run, self.full)
                log.warning("sandbox %s: a download was cut short: %s", self.files.sandbox.sandbox_id, failure)
                raise DownloadCut(str(failure)) from failure
        except BaseException:
            self.finish()
            raise
        self.finish()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.finish()

    def finish(self) -> None:
        if not self.done:
            self.done = True
            try:
                self.run.kill()
                self.run.close()
            finally:
                self.files._release()

    def __del__(self) -> None:
        if not self.done:  # on the loop's thread: the slots wake waiters there
            try:
                self.loop.call_soon_threadsafe(self.finish)
            except RuntimeError:  # the loop is closed: no slot is left to free, the process is
                self.done = True
                self.run.kill()
                if self.run.stderr_fd >= 0:
                    os.close(self.run.stderr_fd)
                    self.run.stderr_fd = -1


class SandboxFiles:
    """File calls of one sandbox, each run inside it by the static helper."""

    def __init__(self, runtime: "IsolationRuntime", sandbox: "SandboxState", reaper: "ChildReaper",
                 agent_slots: asyncio.Semaphore, stall: float = 30.0) -> None:
        self.runtime = runtime
        self.stall = stall  # seconds a helper may make no progress (see _HelperRun)
        self.sandbox = sandbox
        self.reaper = reaper
        self.agent_slots = agent_slots  # file calls in flight over all sandboxes
        self.placement: Optional["Placement"] = None  # the sandbox's as the call started

    async def _acquire(self, path: str) -> str:
        """A slot of this sandbox, then one of the agent's: calls beyond them wait, so no
        caller can run the agent out of processes or descriptors. Then the sandbox is
        checked again (a snapshot or reset may have begun meanwhile: the call must not run
        against the holder it stops) and ``path`` made absolute. Release the slots after."""
        await self.sandbox.file_slots.acquire()
        try:
            await self.agent_slots.acquire()
        except BaseException:
            self.sandbox.file_slots.release()
            raise
        try:
            self.sandbox.check_ready()  # no await from here to the helper's spawn
            self.placement = self.sandbox.placement
            return self.absolute(path)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        self.agent_slots.release()
        self.sandbox.file_slots.release()

    def absolute(self, path: str) -> str:
        if "\0" in path:
            raise FileOperationFailed("path contains a NUL byte")
        assert self.sandbox.placement is not None
        return str(PurePosixPath(self.sandbox.placement.default_cwd) / path)

    # -- the helper process --------------------------------------------------------
    async def _start(self, op: list[str], with_stdin: bool = False) -> _HelperRun:
        argv = self.runtime.file_command(self.sandbox, op)
        out_ours, out_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # close-on-exec both
        in_ours, in_theirs = (socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) if with_stdin
                              else (None, None))
        err_fd = os.memfd_create("file-call-stderr", os.MFD_CLOEXEC)
        stdin_action = ((os.POSIX_SPAWN_DUP2, in_theirs.fileno(), 0) if in_theirs is not None
                        else (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0))
        try:
            pid = os.posix_spawn(argv[0], argv, {}, file_actions=[
                stdin_action, (os.POSIX_SPAWN_DUP2, out_theirs.fileno(), 1), (os.POSIX_SPAWN_DUP2, err_fd, 2),
            ], setsid=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
        except OSError:
            _close_ours(out_ours, in_ours, err_fd)
            raise
        finally:
            for theirs in (out_theirs, in_theirs):
                if theirs is not None:
                    theirs.close()
        exited = self.reaper.wait(pid)
        try:
            reader, stdout_end = await asyncio.open_unix_connection(sock=out_ours, limit=1 << 20)
        except BaseException:
            _close_ours(out_ours, in_ours, err_fd)
            if not exited.done():  # not reaped yet: the pid is still the helper's
                os.kill(pid, signal.SIGKILL)
            raise
        run = _HelperRun(pid, exited, reader, stdout_end, None, err_fd, self.stall)
        if in_ours is not None:
            try:
                run.stdin = (await asyncio.open_unix_connection(sock=in_ours))[1]
            except BaseException:
                in_ours.close()
                run.kill()
                run.close()
                raise
        return run

    async def _failure(self, run: _HelperRun, full: str, not_found_kind: str = "not a regular file") -> Exception:
        """The typed error for a helper run that did not succeed."""
        code = await run.exited
        text = run.stderr().strip()
        if code == FILE_ERROR_EXIT and text.startswith("orchard-file: "):
            reason = text.split(": ", 1)[1].splitlines()[0]
            if reason == "notreg":
                return FileOperationFailed(f"{full}: {not_found_kind}")
            if reason == "toobig":
                return PayloadTooLarge(f"{full}: larger than this route allows; use the raw files route")
            number = int(reason[1:]) if reason[1:].isdigit() else 0
            return FileOperationFailed(f"{full}: {_REASONS.get(number, os.strerror(number))}")
        await settle_holder(self.sandbox)
        if self.sandbox.status == "lost":
            return SandboxLost(f"sandbox {self.sandbox.sandbox_id!r} was lost: {self.sandbox.status_message}")
        if self.sandbox.restarting or self.sandbox.placement is not self.placement:
            return SandboxNotReady(f"sandbox {self.sandbox.sandbox_id!r} was restarted (a snapshot or reset) during "
                                   "the file call; call again")
        if code == HELPER_FAILED_EXIT:
            return RuntimeUnavailable(f"file call could not enter the sandbox: {text[-500:]}")
        cgroup = self.sandbox.cgroup
        oom = "; the sandbox hit its memory limit" if code > 128 and cgroup is not None and cgroup.new_oom_kills() else ""
        return FileOperationFailed(f"{full}: the file call ended with code {code}{oom}")

    @staticmethod
    def _header(line: bytes) -> Optional[int]:
        parts = line.rstrip(b"\n\0").split(b" ")
        if len(parts) == 2 and parts[0] == b"ok" and parts[1].isdigit():
            return int(parts[1])
        return None

    # -- operations ----------------------------------------------------------------
    async def write(self, path: str, chunks: AsyncIterator[bytes], mode: Optional[int] = None) -> tuple[str, int]:
        """Write a file from a byte stream; returns (absolute path, bytes written)."""
        full = await self._acquire(path)
        try:
            return await self._write(full, chunks, mode)
        finally:
            self._release()

    async def _write(self, full: str, chunks: AsyncIterator[bytes], mode: Optional[int]) -> tuple[str, int]:
        run = await self._start(["write", full, str(-1 if mode is None else mode)], with_stdin=True)
        assert run.stdin is not None
        try:
            try:
                async for chunk in chunks:
                    run.stdin.write(chunk)
                    await run.within(run.stdin.drain())
                run.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the helper stopped reading: its exit says why
            except BaseException:
                run.kill()  # the caller's stream failed: leave no half-fed helper behind
                raise
            written = self._header(await run.within(run.stdout.read(64)))
            if await run.within(run.exited) != 0 or written is None:
                raise await self._failure(run, full)
            return full, written
        finally:
            run.close()

    async def open_read(self, path: str, max_bytes: int = -1) -> tuple[str, int, AsyncIterator[bytes]]:
        """(absolute path, size on disk, the bytes as they are read) of a regular file."""
        full = await self._acquire(path)  # held until the caller has read the whole file (or stopped)
        run: Optional[_HelperRun] = None
        try:
            run = await self._start(["read", full, str(max_bytes)])
            size = self._header(await run.within(run.stdout.readline()))
            if size is None:
                run.kill()
                raise await self._failure(run, full)
        except BaseException:
            if run is not None:  # also when cancelled: no helper or descriptor left behind
                run.kill()
                run.close()
            self._release()
            raise
        return full, size, _ReadStream(self, run, full)

    async def read(self, path: str, max_bytes: int) -> tuple[str, bytes]:
        full, _, chunks = await self.open_read(path, max_bytes)
        return full, b"".join([chunk async for chunk in chunks])

    async def list(self, path: str, offset: int, limit: int) -> tuple[str, int, list[FileEntry]]:
        """(absolute path, number of entries, the entries [offset, offset + limit) by name)."""
        full = await self._acquire(path)
        try:
            return await self._list(full, offset, limit)
        finally:
            self._release()

    async def _list(self, full: str, offset: int, limit: int) -> tuple[str, int, list[FileEntry]]:
        run = await self._start(["list", full, str(offset), str(limit)])
        try:
            try:
                total = self._header(await run.within(run.stdout.readuntil(b"\0")))
            except asyncio.IncompleteReadError:
                total = None
            if total is None:
                raise await self._failure(run, full, "not a directory")
            entries = []
            while True:
                try:
                    record = await run.within(run.stdout.readuntil(b"\0"))
                except asyncio.IncompleteReadError:
                    break
                kind, size, seconds, nanos, name = record[:-1].split(b" ", 4)
                entries.append(FileEntry(name=name.decode(errors="backslashreplace"), type=_KINDS[kind.decode()], size=int(size),
                                         modified=int(seconds) + int(nanos) / 1e9))
            if await run.within(run.exited) != 0:
                raise await self._failure(run, full, "not a directory")
            return full, total, entries
        finally:
            run.kill()
            run.close()
