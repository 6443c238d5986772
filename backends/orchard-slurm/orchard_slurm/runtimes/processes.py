"""Watching and joining a container's main process that is not the agent's child (Apptainer
and Podman daemonize it)."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path
from typing import Callable, Optional

NS_GET_PARENT = 0xB702  # ioctl on a namespace fd: its parent user namespace


def user_ns_below_ours(pid: int) -> bool:
    """True when ``pid``'s user namespace is nested in ours (so we may join it)."""
    ours = os.stat("/proc/self/ns/user")
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    try:
        theirs = os.fstat(fd)
        if (theirs.st_ino, theirs.st_dev) == (ours.st_ino, ours.st_dev):
            return False
        while True:
            try:
                parent = fcntl.ioctl(fd, NS_GET_PARENT)
            except OSError:
                return False
            os.close(fd)
            fd = parent
            found = os.fstat(fd)
            if (found.st_ino, found.st_dev) == (ours.st_ino, ours.st_dev):
                return True
    finally:
        os.close(fd)


def process_exit(pid: int) -> "asyncio.Future[int]":
    """A future resolved when ``pid`` (not our child: Apptainer daemonizes it) exits."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        future.set_result(-1)
        return future

    def exited() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        if not future.done():
            future.set_result(-1)  # its status went to its own parent

    loop.add_reader(fd, exited)
    return future


def first_descendant(pid: int, matches: Callable[[int], bool]) -> Optional[int]:
    """The first process at or below ``pid`` (breadth first) for which ``matches`` holds;
    processes that vanish on the way are skipped."""
    pending = [pid]
    while pending:
        current = pending.pop(0)
        try:
            if matches(current):
                return current
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return None
