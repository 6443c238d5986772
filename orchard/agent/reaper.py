"""The agent is a child subreaper: it reaps every descendant that is orphaned to it.

Children we started register a future keyed by pid; their exit drains ``waitid`` and
resolves those futures with the exit status (128 + signal when killed). Orphans
(background processes of finished commands) are simply reaped.

What tells us a child exited depends on the loop: asyncio's lets us have SIGCHLD; uvloop
(the agent's loop where pidfds exist: about a tenth of a millisecond less per command)
keeps SIGCHLD for its own subprocesses, so there each child we started is watched through a
pidfd and orphans are swept up every ``ORPHAN_SWEEP_SECONDS``.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import tempfile
from typing import Callable

_PR_SET_CHILD_SUBREAPER = 36
ORPHAN_SWEEP_SECONDS = 1.0


def become_subreaper() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def exit_code_of(info: os.waitid_result) -> int:
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return 128 + info.si_status


class ChildReaper:
    def __init__(self) -> None:
        self._waiters: dict[int, Callable[[int], None]] = {}
        self._pidfds: dict[int, int] | None = None  # by pid, where SIGCHLD is not ours
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        become_subreaper()
        self._loop = loop
        try:
            loop.add_signal_handler(signal.SIGCHLD, self.reap)
        except RuntimeError:  # uvloop keeps SIGCHLD
            self._pidfds = {}
            self._sweep()

    def _sweep(self) -> None:
        assert self._loop is not None
        self.reap()
        self._loop.call_later(ORPHAN_SWEEP_SECONDS, self._sweep)

    def watch(self, pid: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(exit_code)`` on the loop when ``pid`` exits."""
        self._waiters[pid] = callback
        if self._pidfds is not None and self._loop is not None:
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # already reaped by someone else: nothing will tell us
                fd = -1
            if fd >= 0:
                self._pidfds[pid] = fd
                self._loop.add_reader(fd, self.reap)
        self.reap()  # the child may already be gone

    def _unwatch(self, pid: int) -> None:
        fd = self._pidfds.pop(pid, -1) if self._pidfds is not None else -1
        if fd >= 0 and self._loop is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def wait(self, pid: int) -> "asyncio.Future[int]":
        assert self._loop is not None, "reaper not installed"
        future: asyncio.Future[int] = self._loop.create_future()
        self.watch(pid, lambda code: future.done() or future.set_result(code))
        return future

    def reap(self) -> None:
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                return
            if info is None:
                return
            self._unwatch(info.si_pid)
            callback = self._waiters.pop(info.si_pid, None)
            if callback is not None:
                callback(exit_code_of(info))


async def run_tool(reaper: ChildReaper, argv: list[str], env: dict[str, str],
                   pass_fds: dict[int, int] | None = None) -> tuple[int, str, str]:
    """Run a helper tool to completion through the reaper (asyncio's own child watcher
    would race with our ``waitid(P_ALL)``); returns (exit code, stdout, stderr).
    ``pass_fds`` {our fd: its number in the child} hands descriptors to this child alone."""
    path = shutil.which(argv[0], path=env.get("PATH")) or argv[0]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.posix_spawn(path, argv, env, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out.fileno(), 1),
            (os.POSIX_SPAWN_DUP2, err.fileno(), 2),
            *((os.POSIX_SPAWN_DUP2, ours, theirs) for ours, theirs in (pass_fds or {}).items()),
        ], setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
        code = await reaper.wait(pid)
        out.seek(0)
        err.seek(0)
        return code, out.read().decode(errors="replace"), err.read().decode(errors="replace")
