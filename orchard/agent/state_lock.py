"""One agent per state directory, enforced by an exclusive lock held for the agent's life.

A second agent on the same state directory would take over its socket, wipe the first
one's sandboxes as "leftovers" at start, and remove the other's cgroups on stop. The lock
is an ``flock`` on ``agent/agent.lock``: the kernel drops it when the agent dies, however it
dies, so a crashed agent never blocks the next one.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from orchard.agent.settings import AgentSettings
from orchard.errors import StateDirInUse

log = logging.getLogger(__name__)

LOCK_NAME = "agent.lock"


def hold_state_dir(settings: AgentSettings) -> int:
    """Lock ``settings.state_dir`` for this process and return the lock's descriptor (keep
    it open; close-on-exec, so no command or holder inherits it). Raises ``StateDirInUse``
    naming the agent that holds it."""
    path = settings.agent_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            # Some cluster file systems (Lustre mounted without flock) refuse locks outright:
            # run without the guard rather than not at all, and say so.
            log.warning("cannot lock %s (%s): nothing stops a second agent on state_dir %s", path, exc,
                        settings.state_dir)
            return fd
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateDirInUse(f"another agent (pid {holder}) serves state_dir {str(settings.state_dir)!r}; "
                            "use it, or stop it first (`orchard agent stop`)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
