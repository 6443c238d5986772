"""``slirp``: user-mode networking (slirp4netns) for agents that are not root.

slirp4netns puts a tap device in the sandbox's namespace and turns its traffic into the
agent's own sockets, so it needs no privilege (a Slurm pilot of an ordinary user). It runs
with the host's loopback turned off (``--disable-host-loopback``: 10.0.2.2 does not lead to
127.0.0.1) and with its seccomp filter (its ``--enable-sandbox`` is left out: with it,
slirp4netns 1.2 forwarded no connection here). What it cannot do is filter: a sandbox reaches what the agent's user reaches on
the host's other networks (the LAN, a cloud's metadata address). Where that matters, run
the agent as root (``nat``) or keep ``block_network: true``.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
from typing import Optional

from orchard.agent.egress.api import Egress, tool
from orchard.agent.egress.ranges import resolv_conf_text
from orchard.agent.runtimes.holder import read_when_ready
from orchard.errors import RuntimeUnavailable

log = logging.getLogger("orchard.agent")
SLIRP_DNS = "10.0.2.3"  # slirp4netns's forwarder to the host's resolver
READY_SECONDS = 10.0
NS_GET_USERNS = 0xB701  # ioctl on a namespace: a descriptor of the user namespace that owns it


class SlirpEgress(Egress):
    name = "slirp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._processes: dict[str, tuple[int, int]] = {}  # sandbox id -> (pid, exit-fd write end)

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if tool("slirp4netns") is None:
            return "slirp4netns is not installed (apt-get install slirp4netns)"
        return None

    def resolv_conf(self) -> Optional[str]:
        return resolv_conf_text([SLIRP_DNS])

    async def attach(self, key: str, pid: int) -> None:
        # The namespace and the user namespace that owns it (bwrap's --disable-userns nests
        # another one, which /proc/PID/ns/user names and which has no rights over the network).
        try:
            netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise RuntimeUnavailable(f"sandbox {key!r}: its holder is gone before its network was set up ({exc})") from None
        try:
            owner = fcntl.ioctl(netns, NS_GET_USERNS)
        except OSError as exc:
            os.close(netns)
            raise RuntimeUnavailable(f"cannot find the owner of sandbox {key!r}'s network: {exc}") from None
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe()
        argv = [tool("slirp4netns") or "slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
                "--enable-seccomp", "--ready-fd=3", "--exit-fd=4", "--netns-type=path",
                "--userns-path=/dev/fd/6", "/dev/fd/5", "tap0"]
        log_fd = os.memfd_create("slirp-log", os.MFD_CLOEXEC)
        try:
            child = os.posix_spawn(argv[0], argv, {"PATH": "/usr/bin:/bin"}, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2), (os.POSIX_SPAWN_DUP2, ready_w, 3), (os.POSIX_SPAWN_DUP2, exit_r, 4),
                (os.POSIX_SPAWN_DUP2, netns, 5), (os.POSIX_SPAWN_DUP2, owner, 6),
            ], setsid=True)
        except OSError as exc:
            for fd in (ready_r, ready_w, exit_r, exit_w, log_fd):
                os.close(fd)
            raise RuntimeUnavailable(f"slirp4netns could not start: {exc}") from None
        finally:
            os.close(netns)
            os.close(owner)
        os.close(ready_w)
        os.close(exit_r)
        exited = self.reaper.wait(child)
        try:
            ready = (await asyncio.wait_for(read_when_ready(ready_r, exited), READY_SECONDS)).startswith(b"1")
        except asyncio.TimeoutError:
            ready = False
        finally:
            os.close(ready_r)
        if not ready:
            message = os.pread(log_fd, 4096, 0).decode(errors="replace").strip() or "no message"
            os.close(log_fd)
            os.close(exit_w)
            _kill(child)
            raise RuntimeUnavailable(f"slirp4netns failed: {message}")
        os.close(log_fd)
        self._processes[key] = (child, exit_w)

    async def detach(self, key: str) -> None:
        entry = self._processes.pop(key, None)
        if entry is not None:
            child, exit_w = entry
            os.close(exit_w)  # slirp4netns exits when its exit fd closes
            _kill(child)

    async def close(self) -> None:
        for child, exit_w in self._processes.values():
            os.close(exit_w)
            _kill(child)
        self._processes.clear()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
