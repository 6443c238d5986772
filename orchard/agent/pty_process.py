"""One process on a pseudo-terminal inside a sandbox: spawned through ``orchard-enter --pty``
exactly as a command is (the sandbox's namespaces, cgroup, uid, no capabilities, seccomp).

The terminal is allocated by the helper *inside* the sandbox, on the sandbox's own devpts
instance, after it has joined the sandbox and dropped to the sandbox uid: the sandboxed
process only ever holds the slave of a terminal that belongs to the sandbox (no host
``/dev/pts`` slave, nothing of the agent's terminal). The agent gets the master over a Unix
socket (SCM_RIGHTS) and reads it only when the client has taken the previous chunk, so a
reader that stops reading stops the process at its next write (back-pressure), never the
agent's memory.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import signal
import socket
import struct
import termios
from pathlib import Path
from typing import Optional

from orchard.agent.reaper import ChildReaper
from orchard.agent.runtimes.api import IsolationRuntime
from orchard.agent.sandbox import SandboxState
from orchard.errors import InternalError, InvalidRequest

SPAWN_TIMEOUT = 30.0
TIOCSIG = getattr(termios, "TIOCSIG", 0x40045436)  # pty master: signal the slave's foreground group


def _pid_namespace(pid: object) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _sandbox_pid(host_pid: int) -> int:
    """The pid the process has inside its sandbox (the last NSpid), else the host one."""
    try:
        for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return host_pid


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    loop.add_reader(fd, lambda: future.done() or future.set_result(None))
    try:
        await future
    finally:
        loop.remove_reader(fd)


class PtyProcess:
    """A started process and the agent's end of its terminal."""

    def __init__(self, master: int, control: socket.socket, helper_pid: int, pid: int,
                 exited: "asyncio.Future[int]", pid_namespace: Optional[tuple[int, int]] = None) -> None:
        self.master = master
        self.pid_namespace = pid_namespace  # the sandbox's PID namespace: only its groups get signals
        self.control = control
        self.helper_pid = helper_pid
        self.pid = pid  # host pid of the process (its own session and process group)
        self.sandbox_pid = _sandbox_pid(pid)
        self._exited = exited
        self.exit_code: Optional[int] = None

    @classmethod
    async def spawn(cls, reaper: ChildReaper, runtime: IsolationRuntime, sandbox: SandboxState, argv: list[str],
                    env: dict[str, str], cwd: str, rows: int, cols: int) -> "PtyProcess":
        full = runtime.command(sandbox, argv, cwd)
        if full[0] != str(runtime.context.helper):
            raise InvalidRequest(f"runtime {runtime.name!r} cannot run interactive processes")
        full = [full[0], "--pty", "3", "--rows", str(rows), "--cols", str(cols), *full[1:]]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        errors = os.memfd_create("pty-helper-errors", os.MFD_CLOEXEC)
        their_fd = theirs.fileno() if theirs.fileno() != 3 else os.dup(theirs.fileno())  # dup2(3, 3) keeps CLOEXEC
        try:
            helper_pid = os.posix_spawn(full[0], full, env, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, errors, 1),
                (os.POSIX_SPAWN_DUP2, errors, 2),
                (os.POSIX_SPAWN_DUP2, their_fd, 3),
            ], setsid=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM))
        finally:
            if their_fd != theirs.fileno():
                os.close(their_fd)
            theirs.close()
        exited = reaper.wait(helper_pid)
        try:
            ours.setblocking(False)
            master, pid = await cls._receive_master(ours, exited, errors)
        except BaseException:
            ours.close()
            if not exited.done():
                os.kill(helper_pid, signal.SIGKILL)
            raise
        finally:
            os.close(errors)
        os.set_blocking(master, False)
        target = sandbox.placement.target_pid if sandbox.placement is not None else None
        return cls(master, ours, helper_pid, pid, exited, _pid_namespace(target if target is not None else "self"))

    @staticmethod
    async def _receive_master(ours: socket.socket, exited: "asyncio.Future[int]", errors: int) -> tuple[int, int]:
        reading = asyncio.ensure_future(_readable(ours.fileno()))
        try:
            await asyncio.wait([reading, exited], timeout=SPAWN_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        finally:
            reading.cancel()
        try:
            data, fds, _, _ = socket.recv_fds(ours, 64, 1)
        except BlockingIOError:
            data, fds = b"", []
        if not fds:
            if not exited.done():
                raise InternalError("the interactive process did not start in time")
            os.lseek(errors, 0, os.SEEK_SET)
            message = os.read(errors, 4096).decode(errors="replace").strip()
            raise InvalidRequest(f"cannot start the interactive process: {message or f'exit {exited.result()}'}")
        return fds[0], int(data)

    # -- I/O ---------------------------------------------------------------------------
    async def read(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of terminal output; b"" once the terminal has no writer left."""
        while True:
            try:
                return os.read(self.master, limit)
            except BlockingIOError:
                await _readable(self.master)
            except OSError as exc:
                if exc.errno == errno.EIO:  # every slave closed
                    return b""
                raise

    def read_now(self, limit: int) -> bytes:
        """What is buffered now, without waiting (b"" when nothing is)."""
        try:
            return os.read(self.master, limit)
        except OSError:
            return b""

    def write_now(self, data: bytes) -> int:
        """How much of ``data`` the terminal took without waiting (all of it once the process is gone)."""
        try:
            return os.write(self.master, data)
        except BlockingIOError:
            return 0
        except OSError:
            return len(data)

    async def write(self, data: bytes) -> None:
        """All of ``data`` to the terminal's input; waits (back-pressure) while it is full."""
        view = memoryview(data)
        loop = asyncio.get_running_loop()
        while view:
            try:
                written = os.write(self.master, view)
                view = view[written:]
            except BlockingIOError:
                future = loop.create_future()
                loop.add_writer(self.master, lambda: future.done() or future.set_result(None))
                try:
                    await asyncio.wait([future, self._exited], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    loop.remove_writer(self.master)
                if self._exited.done():
                    return
            except OSError:
                return  # the process is gone; its exit says the rest

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def signal(self, sig: int) -> None:
        """To the terminal's foreground process group (what a key such as Ctrl-C reaches)
        and to the process's own group.

        The foreground group is the sandbox's to choose, and a group that emptied keeps its
        number on the terminal although the host may have given that number to one of its
        own processes since: INT and QUIT go through the terminal (TIOCSIG, the kernel's own
        reference to the group), and a group is signalled by number only while its leader is
        a live process of the sandbox's PID namespace."""
        if self._exited.done():
            return
        groups = {self.pid}
        if sig in (signal.SIGINT, signal.SIGQUIT):
            try:
                fcntl.ioctl(self.master, TIOCSIG, sig)
            except OSError:
                pass
        else:
            try:
                groups.add(struct.unpack("i", fcntl.ioctl(self.master, termios.TIOCGPGRP, b"\0" * 4))[0])
            except OSError:
                pass
        for group in groups:
            if group > 0 and self.pid_namespace is not None and _pid_namespace(group) == self.pid_namespace:
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    if group == self.pid:  # just forked, not yet its group's leader (setsid comes first
                        try:  # thing in the child, but the pid reaches us before): the process itself
                            os.kill(self.pid, sig)
                        except (ProcessLookupError, PermissionError):
                            pass
                except PermissionError:
                    pass

    def kill(self) -> None:
        """End the process and what it started in its session's groups; its helper relays the end."""
        if not self._exited.done():
            self.signal(signal.SIGKILL)
            try:
                os.kill(self.helper_pid, signal.SIGKILL)  # the command dies with it (parent-death signal)
            except ProcessLookupError:
                pass

    @property
    def done(self) -> bool:
        return self._exited.done()

    async def wait(self) -> int:
        """The exit code: negative when a signal ended it (as the wire says)."""
        if self.exit_code is None:
            relayed = await self._exited
            self.exit_code = self._relayed_status(relayed)
        return self.exit_code

    def _relayed_status(self, helper_code: int) -> int:
        try:
            data = self.control.recv(64)
        except OSError:
            data = b""
        kind, _, value = data.decode(errors="replace").partition(" ")
        if kind == "exit" and value.isdigit():
            return int(value)
        if kind == "signal" and value.isdigit():
            return -int(value)
        return -(helper_code - 128) if helper_code > 128 else helper_code

    def close(self) -> None:
        for closing in (lambda: os.close(self.master), self.control.close):
            try:
                closing()
            except OSError:
                pass
        self.master = -1
