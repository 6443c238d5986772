"""One agent per state directory, enforced by an exclusive lock held for the agent's life.

A second agent on the same state directory would take over its socket, wipe the first
one's sandboxes as "leftovers" at start, and remove the other's cgroups on stop. The lock
is an ``flock`` on ``agent/agent.lock``: the kernel drops it when the agent dies, however it
dies, so a crashed agent never blocks the next one. Who holds it is asked of the kernel
(``/proc/locks``), never read from a file or a command line a process could forge.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path
from typing import Optional

from orchard.agent.settings import AgentSettings
from orchard.errors import RuntimeUnavailable, StateDirInUse

log = logging.getLogger(__name__)

LOCK_NAME = "agent.lock"
PROC_LOCKS = Path("/proc/locks")


def lock_holder(settings: AgentSettings) -> Optional[int]:
    """The pid of the live process holding ``settings.state_dir``'s agent lock, or None."""
    try:
        st = os.stat(settings.agent_dir / LOCK_NAME, follow_symlinks=False)
        lines = PROC_LOCKS.read_text().splitlines()
    except OSError:
        return None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 27655 fe:00:2150722 0 EOF" (a waiter's: "1: -> FLOCK ...")
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == where:
            pid = int(fields[4])
            return pid if pid > 0 else None
    return None


def hold_state_dir(settings: AgentSettings) -> int:
    """Lock ``settings.state_dir`` for this process and return the lock's descriptor (keep
    it open; close-on-exec, so no command or holder inherits it). Raises ``StateDirInUse``
    naming the agent that holds it."""
    path = settings.agent_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        raise RuntimeUnavailable(f"cannot open the agent lock {str(path)!r}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RuntimeUnavailable(f"the agent lock {str(path)!r} is not a regular file; remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            # Some cluster file systems (Lustre mounted without flock) refuse locks outright:
            # run without the guard rather than not at all, and say so.
            log.warning("cannot lock %s (%s): nothing stops a second agent on state_dir %s", path, exc,
                        settings.state_dir)
            return fd
        os.close(fd)
        raise StateDirInUse(f"another agent (pid {lock_holder(settings) or 'unknown'}) serves state_dir "
                            f"{str(settings.state_dir)!r}; use it, or stop it first (`orchard agent stop`)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for people; programs ask lock_holder
    return fd
