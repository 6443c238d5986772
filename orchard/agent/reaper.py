"""The agent is a child subreaper: it reaps every descendant that is orphaned to it.

Children we started register a future keyed by pid; SIGCHLD drains ``waitid`` and
resolves those futures with the exit status (128 + signal when killed). Orphans
(background processes of finished commands) are simply reaped.
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


def become_subreaper() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def exit_code_of(info: os.waitid_result) -> int:
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return 128 + info.si_status


class ChildReaper:
    def __init__(self) -> None:
        self._waiters: dict[int, Callable[[int], None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        become_subreaper()
        self._loop = loop
        loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def watch(self, pid: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(exit_code)`` on the loop when ``pid`` exits."""
        self._waiters[pid] = callback
        self.reap()  # the child may already be gone

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
