"""Commands forked by the sandbox's holder instead of one ``orchard-enter`` exec each.

The next command's process is forked ahead (``prepare``, as each command starts): the
holder forks a child, the child says who it is, joins the next job's cgroup when the agent
hands it that group's ``tasks`` file, and waits, all off the critical path. (A thread that
moves itself skips the kernel's global threadgroup lock; the agent writing the child's pid
would wait for an RCU grace period, about 10 ms, before the next command could start.) Starting a command is then one message to
that child (the command, its environment and stdio) and its one-byte acknowledgement.

Where the sandbox's shell is bash, the prepared child goes one step further: it execs
``bash`` at once (``SHELL_WRAPPER``), with the next job's output files, and that bash
waits for its command; starting a command is then writing it and closing a pipe, with
bash's own start (about 1 ms of a 2 ms ``true``) already behind it. The command runs as
``bash -c`` would run it, through ``eval`` (what differs is listed at ``SHELL_WRAPPER``);
a request with its own environment, stdin or a login shell takes the step above instead.

The holder (``orchard-enter --hold --spawner FD``, see ``runtimes/enter_spawner.c``) is
PID 1 of the sandbox, already in its root, with its uid, no capabilities and its seccomp
filter. The agent keeps the other end of a socket pair made before the holder started, so
nothing in the sandbox can reach the holder's socket (there is no path to it), and the
holder is not dumpable (no ptrace, no /proc/1/fd, no pidfd_getfd for the sandbox's uid).

Everything the holder says is a claim of the sandbox about itself and is checked:
- a command's pid comes from the kernel (SCM_CREDENTIALS, sent by the command's own
  process before it execs), then is pinned with a pidfd and checked to live in the
  sandbox's PID namespace before the agent hands it its job's cgroup or signals it; that it
  joined the group is read from the group's member list, not taken from its answer;
- its exit code is a number the command could have chosen anyway; the end of the command
  is also seen through the pidfd, so a report that never comes fails the job after a grace
  period, typed, never a hang;
- anything that goes wrong before the command starts (no answer in time, a malformed
  answer, a pid outside the sandbox, a prepared child that died or got no acknowledgement
  out) makes the caller run it the old way (``orchard-enter``); a child the sandbox killed
  while it waited is replaced once first.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import select
import signal
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from orchard.agent.cgroups import members
from orchard.agent.process_marks import MARK, new_mark

if TYPE_CHECKING:
    from orchard.agent.cgroups import SandboxCgroup

log = logging.getLogger(__name__)

SPAWNER_FD = 5  # the holder's end, as the holder sees it (``--spawner 5``)
PAYLOAD_MAX = 60 * 1024  # enter_spawner.c's SPAWN_PAYLOAD_MAX: longer requests go the old way
# Seconds for the holder to fork and the child to say who it is, or to take its command.
# A miss retires the spawner for good (the sandbox's commands go through orchard-enter, which
# costs more CPU, so an overload fed itself), and a command taken after it fails the job; 2 s
# ran out about 20 times in 8 minutes at a load of 30+ on 2 cores. Only the sandbox's own
# commands wait on it: a sandbox stopping its prepared process delays itself, once.
START_TIMEOUT = 10.0
REPORT_GRACE = 10.0  # seconds between the command's end (pidfd) and the holder's report; 2 s ran out once on an
# overloaded machine (load 30+ on 2 cores) and failed a rollout; a holder that died closes its socket (SpawnerLost
# at once), so this wait only bounds a live holder that is late or stuck, and costs nothing on the usual path
DEATH_GRACE = 0.1  # seconds for a child missing from its group to show it died (not lied)
_UCRED = struct.Struct("iII")

# What a prestarted bash runs (``bash -c SHELL_WRAPPER bash``): wait until the agent closes
# the pipe on descriptor 3, read "CWD\0COMMAND\0" from the memfd on 4 (a file: bash reads it
# in blocks, not a byte per call as from a pipe), enter CWD, drop both descriptors and what
# its start set differently from a fresh ``bash -c`` (OLDPWD, SECONDS, ``$_``), and run the
# command with ``eval``. Checked the same as ``bash -c``: $0, $#, $_, $-, $LINENO, FUNCNAME,
# BASH_SOURCE, BASH_EXECUTION_STRING, PWD and OLDPWD, SECONDS, SHLVL, exit codes, traps,
# ``return`` and ``exit``, "command not found", the open descriptors, no variable of its
# own left. What differs: a syntax error reads ``bash: eval: line N:`` where ``bash -c``
# says ``bash: -c: line N:`` (exit code 2 either way); the process's command line (``ps``)
# shows this wrapper; PIPESTATUS is set (to 0) before the command's first pipeline; and what
# bash reads as it starts (the bash binary on PATH, locale files) is read while the previous
# command may still run, so a command that replaces those is seen by the command after next.
# One line: $LINENO inside counts from the command's own start. Never used where the
# sandbox's environment sets what a bash reads at start or that would change the wrapper
# itself (``prestartable``).
SHELL_WRAPPER = (
    'read -r -u 3 c; IFS= read -r -d "" -u 4 c && builtin cd -P -- "$c" 2>/dev/null'
    ' || { builtin printf "orchard-enter: chdir %s: cannot enter it\\n" "$c" >&2; exit 125; };'
    ' IFS= read -r -d "" -u 4 c; exec 3<&- 4<&-; unset OLDPWD; declare -x OLDPWD; SECONDS=0;'
    ' BASH_EXECUTION_STRING=$c; unset c; : "$0"; eval "$BASH_EXECUTION_STRING"')


class SpawnerUnavailable(Exception):
    """The command did not start through the spawner: run it through orchard-enter instead."""


class SpawnerLost(Exception):
    """The command started, but how it ended is unknown (the holder went silent or away)."""


@dataclass
class Spawned:
    pid: int  # host pid, from the kernel; the command's session and process group
    pidfd: int  # pins the process: signals through it never reach a reused pid
    exited: "asyncio.Future[int]"
    loop: asyncio.AbstractEventLoop
    cgroup: Optional[Path] = None  # the job's cgroup (v1: a child of the pids group) it was put in
    shell: "Optional[ShellStart]" = None  # set when a prestarted bash ran the command

    def alive(self) -> bool:
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
            return True
        except OSError:
            return False

    def ended(self) -> bool:
        """Whether it has exited (its pidfd reads ready then; a zombie still takes signals).
        poll, not select: an agent with many sandboxes has descriptors past select's 1024."""
        if self.pidfd < 0:
            return True
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def kill(self) -> None:
        """SIGKILL the command itself, and its process group while the command still lives
        (then its pid, and so its group's id, cannot belong to anyone else)."""
        if self.pidfd < 0:
            return
        try:
            if self.alive():
                os.killpg(self.pid, signal.SIGKILL)
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except OSError:
            pass

    def close(self) -> None:
        if self.pidfd >= 0:
            self.loop.remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = -1


# Variables that make bash run code or change its options as it starts (rc files, xtrace,
# errexit), or define functions (exported ones): they would act on the wrapper itself, or be
# read before the previous command has ended (a BASH_ENV file it wrote).
_STARTUP_VARIABLES = frozenset({"BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "POSIXLY_CORRECT", "BASH_XTRACEFD"})


def prestartable(env: dict[str, str]) -> bool:
    """Whether a sandbox with this environment can have its commands' bash started ahead."""
    return not any(name in _STARTUP_VARIABLES or name.startswith("BASH_FUNC_") for name in env)


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (a stopped process takes no command and reports nothing)."""
    try:  # opened each time: a descriptor per sandbox would count against the agent's limit
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # gone: its end tells
        return False
    try:
        return os.read(fd, 512).rpartition(b")")[2][1:2] in (b"T", b"t")
    except OSError:
        return False
    finally:
        os.close(fd)


def pid_namespace(pid: int) -> tuple[int, int]:
    st = os.stat(f"/proc/{pid}/ns/pid")
    return st.st_dev, st.st_ino


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(agent's end, holder's end); both close-on-exec: pass the holder's end by dup2 only."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


@dataclass
class ShellStart:
    """What a prestarted bash was started with, and so what its command's job inherits."""

    stdout: int  # memfds it writes its output to: the job's spool files
    stderr: int
    mark: str  # its environment's job mark (``process_marks``)

    def close(self) -> None:
        for fd in (self.stdout, self.stderr):
            os.close(fd)


@dataclass
class _WaitingShell:
    """A prestarted bash waiting for its command (``SHELL_WRAPPER``)."""

    go: int  # the write end of the pipe on its descriptor 3: closing it starts the command
    text: int  # the memfd on its descriptor 4, for "CWD\0COMMAND\0"
    start: ShellStart

    def close(self) -> None:
        for fd in (self.go, self.text):
            if fd >= 0:
                os.close(fd)
        self.go = self.text = -1


@dataclass
class _Prepared:
    """A child forked ahead of its command: verified, in its job's cgroup, waiting on ``ctl``
    (or, with ``shell``, already bash, waiting for its command)."""

    spawned: Spawned
    ctl: socket.socket
    shell: Optional[_WaitingShell] = None
    kill_group: Optional[Callable[[], None]] = None  # SIGKILL everything in its job's group

    def discard(self) -> None:
        """Kill it and whatever its group holds: a waiting bash is the sandbox's to reach
        (same uid: ptrace, /proc/PID/fd), so processes may have been forked there."""
        self.spawned.kill()
        self.spawned.close()
        if self.kill_group is not None:
            self.kill_group()
        self.ctl.close()
        if self.shell is not None:
            self.shell.close()
            self.shell.start.close()


def _nul_terminated(strings: list[str]) -> bytes:
    """Each string NUL-terminated, as the holder's child and the prestarted shell read them;
    longer than PAYLOAD_MAX, or with a NUL inside, the command goes through orchard-enter."""
    if any("\0" in s for s in strings):
        raise SpawnerUnavailable("a NUL byte in the command or its environment")
    payload = b"".join(s.encode(errors="surrogateescape") + b"\0" for s in strings)
    if len(payload) > PAYLOAD_MAX:
        raise SpawnerUnavailable("request too long for the spawner")
    return payload


def _shell_text(cwd: str, command: str) -> bytes:
    """What a prestarted bash reads: "CWD\0COMMAND\0"."""
    return _nul_terminated([cwd, command])


def _encoded(argv: list[str], env: dict[str, str], cwd: str) -> bytes:
    return _nul_terminated([cwd, str(len(argv)), *argv, *(f"{k}={v}" for k, v in env.items())])


class SpawnerClient:
    """The agent's end of one holder's spawner socket."""

    def __init__(self, sock: socket.socket, holder_pid: int, cgroup: "Optional[SandboxCgroup]" = None,
                 shell_env: Optional[dict[str, str]] = None) -> None:
        """``shell_env``: the environment of the sandbox's commands where its shell is bash;
        then the prepared process is a prestarted bash (``SHELL_WRAPPER``)."""
        self.sock = sock
        self.shell_env = shell_env
        self._shell_next = shell_env is not None  # what the next prepared process is: follows the last request
        self.sock.setblocking(False)
        self.namespace = pid_namespace(holder_pid)  # the sandbox's: the holder is its PID 1
        self._holder_pid = holder_pid
        self.cgroup = cgroup
        self.alive = True  # takes new commands; False once retired or closed (then: orchard-enter)
        self._reading = True
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._running: set[asyncio.Future[int]] = set()  # ends of commands started and not yet reported
        self._next: Optional[asyncio.Task[_Prepared]] = None
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self._on_readable)

    def close(self) -> None:
        """The holder is gone, or the sandbox is: every command still waiting hears SpawnerLost."""
        self.alive = False
        if self._reading:
            self._loop.remove_reader(self.sock.fileno())
            self._reading = False
        self.sock.close()
        if self._next is not None:
            self._forget(self._next)
            self._next = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(SpawnerLost("the sandbox's holder closed its spawner socket"))
                future.exception()  # a waiting prepared process's end is nobody's news; a command's is awaited
        self._pending.clear()

    def _on_readable(self) -> None:
        while True:
            try:
                data = self.sock.recv(128)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.close()
                return
            self._report(data)

    def _report(self, data: bytes) -> None:
        parts = data.split()
        if len(parts) != 3 or parts[0] not in (b"exit", b"fail") or not parts[1].isdigit():
            log.warning("spawner: ignored a malformed report %r", data[:64])
            return
        future = self._pending.pop(int(parts[1]), None)
        try:
            value = int(parts[2])
        except ValueError:
            value = -1
        if future is None or future.done():
            return
        if parts[0] == b"fail":
            future.set_exception(SpawnerUnavailable(f"the holder could not fork: {os.strerror(value) if value > 0 else value}"))
        elif 0 <= value <= 255 + 128:
            future.set_result(value)
        else:
            future.set_exception(SpawnerLost(f"the holder reported an impossible exit code {value}"))

    # -- preparing the next command's process ---------------------------------------
    def prepare(self) -> None:
        """Fork the next command's process now (a no-op while one is ready or on its way)."""
        if self.alive and self._next is None:
            self._next = self._loop.create_task(self._prepare())

    def drop_prepared(self) -> None:
        """Kill the process waiting for the next command, with its job group, and prepare
        anew later. Called when a job is killed: a prestarted bash is dumpable, so the killed
        job's processes (same uid) could have ptraced it and forked into the next job's group,
        out of reach of their own job's kill."""
        if self._next is not None:
            self._forget(self._next)
            self._next = None

    def _forget(self, task: "asyncio.Task[_Prepared]") -> None:
        """Drop a preparation nobody will use: discard the child it made now (before anything
        is prepared anew), or cancel it (its cancellation kills the child and its group,
        ``_prepare_in``; one finishing meanwhile is discarded when it does)."""
        def discard(done: "asyncio.Task[_Prepared]") -> None:
            if not done.cancelled() and done.exception() is None:
                done.result().discard()

        if task.done():
            discard(task)
            return
        task.cancel()
        task.add_done_callback(discard)

    async def _prepare(self) -> _Prepared:
        job_cgroup = self.cgroup.claim_job_dir() if self.cgroup is not None else None
        try:
            return await self._prepare_in(job_cgroup)
        finally:
            if self.cgroup is not None:
                self.cgroup.release_job_dir(job_cgroup)  # placed (no longer empty), or given up

    async def _prepare_in(self, job_cgroup: Optional[Path]) -> _Prepared:
        self._next_id += 1
        request_id = self._next_id
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        exited: asyncio.Future[int] = self._loop.create_future()
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            ours.setblocking(False)
            self._pending[request_id] = exited
            try:
                self.sock.sendmsg([b"%d" % request_id], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                          array.array("i", [theirs.fileno()]))])
            except OSError as exc:  # a full buffer (the holder stopped reading), or it is gone
                raise SpawnerUnavailable(f"could not reach the spawner: {exc}") from None
            finally:
                theirs.close()
            pid = await self._hello(ours, exited)
            spawned = self._verified(pid, exited)
            spawned.cgroup = job_cgroup
            shell: Optional[_WaitingShell] = None
            theirs_fds: tuple[int, ...] = ()  # the shell's descriptors only the child keeps, until sent
            handed = verified = False  # the group's descriptor went out; the child's answer was read back
            try:
                if self._shell_next and self.shell_env is not None:  # made first: failing here hands out no group
                    payload, shell, theirs_fds = self._shell_request(self.shell_env)
                # The placement and the shell's start go together (the child takes them in
                # order): one wait for both answers. The placement is read back from the group
                # before the shell is handed a command; until then nothing of a command runs
                # there (the sandbox's own processes can reach the waiting bash: see ``drop_prepared``).
                if job_cgroup is not None:
                    self._hand_group(ours, job_cgroup)
                    handed = True
                if shell is not None:
                    sent, theirs_fds = theirs_fds, ()
                    self._send_shell(ours, payload, shell, sent)
                if job_cgroup is not None:
                    await self._joined(ours, spawned, job_cgroup)
                    verified = True
                signal.pidfd_send_signal(spawned.pidfd, 0)  # still the same process
                if shell is not None:
                    await self._shell_started(ours, spawned)
            except BaseException as exc:
                spawned.kill()  # before the group is released: a killed child starts no join (one in flight may land; its group then reads busy, or is killed with it)
                spawned.close()
                for fd in theirs_fds:
                    os.close(fd)
                if shell is not None:
                    shell.close()
                    shell.start.close()
                if handed and job_cgroup is not None and self.cgroup is not None:
                    self.cgroup.kill_all(job_cgroup)  # a shell it started is the sandbox's to reach (and fork from)
                    if not verified:  # its descriptor went to a process that did not use it as asked
                        self._retire_group(job_cgroup)
                if isinstance(exc, OSError):
                    raise SpawnerUnavailable(f"could not place the command in its cgroup: {exc}") from None
                raise
        except BaseException:
            self._pending.pop(request_id, None)
            if not exited.done():
                exited.cancel()
            elif not exited.cancelled():
                exited.exception()  # its end is told by the exception raised here
            ours.close()
            raise
        self._watch_end(spawned)
        if shell is not None:
            ours.close()  # the shell's end closed as it started: one descriptor less per idle sandbox
        group = self.cgroup
        kill_group = (lambda: group.kill_all(job_cgroup)) if group is not None and job_cgroup is not None else None
        return _Prepared(spawned, ours, shell, kill_group)

    def _shell_request(self, env: dict[str, str]) -> tuple[bytes, _WaitingShell, tuple[int, int]]:
        """What the prepared child needs to exec the waiting bash with the next job's output
        files: the request, the shell's descriptors the agent keeps, and the two only the
        child keeps (stdin's /dev/null, the read end of the pipe it waits on)."""
        mark = new_mark()
        payload = _encoded(["bash", "-c", SHELL_WRAPPER, "bash"], {**env, MARK: mark}, "/")
        made: list[int] = []
        try:  # out of descriptors (EMFILE): the command runs the plain way, or through orchard-enter
            for name in ("stdout", "stderr", "command"):  # the names a command sees in /proc/self/fd
                made.append(os.memfd_create(name, os.MFD_CLOEXEC))
            made.extend(os.pipe2(os.O_CLOEXEC))
            made.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            for fd in made:
                os.close(fd)
            raise SpawnerUnavailable(f"no descriptors for a prestarted shell: {exc}") from None
        stdout, stderr, text, read_end, go, null = made
        return payload, _WaitingShell(go, text, ShellStart(stdout, stderr, mark)), (null, read_end)

    def _send_shell(self, ctl: socket.socket, payload: bytes, shell: _WaitingShell, theirs: tuple[int, ...]) -> None:
        """Ask the prepared child to exec the waiting bash (its answer: ``_shell_started``);
        ``theirs`` are closed here, sent or not."""
        null, read_end = theirs
        try:
            ctl.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                     array.array("i", [null, shell.start.stdout, shell.start.stderr, read_end, shell.text]))])
        except OSError as exc:
            raise SpawnerUnavailable(f"the prepared process is gone: {exc}") from None
        finally:
            os.close(null)
            os.close(read_end)

    async def _shell_started(self, ctl: socket.socket, spawned: Spawned) -> None:
        """The child's acknowledgement that it execs the shell."""
        taken = await self._readable(ctl, spawned.exited)
        try:
            acknowledged = taken and ctl.recv(1) == b"x"
        except OSError:
            acknowledged = False
        if not acknowledged:
            raise SpawnerUnavailable("the prepared process did not start its shell")

    def _hand_group(self, ctl: socket.socket, job_cgroup: Path) -> None:
        """Hand the prepared child its job group's ``tasks`` file; it writes "0" there (moving
        itself) and answers "g" (read by ``_joined``).

        Invariant: the child is not dumpable from its fork until it has closed that descriptor
        (enter_spawner.c), so no process of the sandbox can take it (ptrace, /proc/PID/fd,
        pidfd_getfd). Written to by another holder, it could move the sandbox's own threads into
        this group (cgroup v1 checks the opener's credentials): out of reach of a job's kill,
        never outside the sandbox. A group whose descriptor went out unused is retired."""
        fd = os.open(job_cgroup / "tasks", os.O_WRONLY | os.O_CLOEXEC)
        try:
            ctl.sendmsg([b"g"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        except OSError as exc:
            raise SpawnerUnavailable(f"the prepared process is gone: {exc}") from None
        finally:
            os.close(fd)

    async def _joined(self, ctl: socket.socket, spawned: Spawned, job_cgroup: Path) -> None:
        """The child's "g"; whether it joined is read from the group, not believed."""
        if not await self._readable(ctl, spawned.exited):
            if not spawned.exited.done():
                self._unhealthy("a prepared process did not join its job's cgroup in time")
            raise SpawnerUnavailable("the prepared process did not join its job's cgroup")
        try:
            answer = ctl.recv(1)
        except OSError:
            answer = b""
        if answer != b"g":
            raise SpawnerUnavailable("the prepared process could not join its job's cgroup")
        if spawned.pid not in members(job_cgroup, "tasks"):  # its own thread, not just any of its threads
            if await self._ends_within(spawned, DEATH_GRACE):  # the sandbox may kill it (same uid)
                raise SpawnerUnavailable("the prepared process died as it joined its job's cgroup")
            self._unhealthy(f"process {spawned.pid} said it joined {job_cgroup.name} and did not")
            raise SpawnerUnavailable("the prepared process is not in its job's cgroup")

    async def _ends_within(self, spawned: Spawned, seconds: float) -> bool:
        """Whether the process ends within ``seconds``: the kernel drops an exiting thread from
        its group's ``tasks`` a moment before its pidfd reads ready, so a child killed right
        after its answer may be missing from the group and not yet ended; a liar still lives."""
        return spawned.ended() or await self._ready(spawned.pidfd, seconds)

    def _retire_group(self, job_cgroup: Path) -> None:
        """The group's ``tasks`` descriptor went to a process that did not say it used it and
        closed it: never hand that group out again (a new one is made)."""
        if self.cgroup is not None:
            self.cgroup.retire_job_dir(job_cgroup)

    async def _readable(self, sock: socket.socket, exited: "asyncio.Future[int]") -> bool:
        """Wait until ``sock`` is readable (True), or the process ended or START_TIMEOUT passed."""
        return await self._ready(sock.fileno(), START_TIMEOUT, exited)

    async def _ready(self, fd: int, timeout: float, *also: "asyncio.Future[int]") -> bool:
        """Wait until ``fd`` reads ready (True), or one of ``also`` is done or ``timeout`` passed.
        An answer already there is taken without a turn of the loop; otherwise one future woken
        by the reader, the timer or ``also`` (``asyncio.wait`` costs a set, tasks and callbacks
        more, three times per command)."""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if poller.poll(0):
            return True
        waiter = self._loop.create_future()
        readable = False

        def wake(*_: object) -> None:
            if not waiter.done():
                waiter.set_result(None)

        def on_readable() -> None:
            nonlocal readable
            readable = True
            wake()

        self._loop.add_reader(fd, on_readable)
        timer = self._loop.call_later(timeout, wake)
        for future in also:
            future.add_done_callback(wake)
        try:
            await waiter
        finally:
            self._loop.remove_reader(fd)
            timer.cancel()
            for future in also:
                future.remove_done_callback(wake)
        return readable

    async def _take(self) -> _Prepared:
        """The prepared child, or a new one; one the sandbox killed while it waited (or while it
        was being prepared, with nobody waiting for it) is replaced once."""
        for attempt in range(2):
            self.prepare()
            if self._next is None:
                raise SpawnerUnavailable("the spawner is gone")
            task = self._next
            try:
                prepared = await asyncio.shield(task)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if task.cancelled() and (current is None or not current.cancelling()):
                    # close() dropped the preparation (the holder went away): not our cancellation
                    raise SpawnerUnavailable("the spawner closed while preparing the command's process") from None
                if not task.done():
                    self._next = None
                    self._forget(task)
                raise
            except SpawnerUnavailable:
                if attempt == 0 and self.alive:  # a stale failure of an unawaited preparation
                    continue
                raise
            finally:
                if self._next is task and task.done():
                    self._next = None
            if prepared.spawned.exited.done() or not prepared.spawned.alive() or _stopped(prepared.spawned.pid):
                prepared.discard()  # killed or stopped by the sandbox (same uid) while it waited
                continue
            if _stopped(self._holder_pid):  # a stopped holder would never report how the command ended
                prepared.discard()
                self._unhealthy("the holder is stopped (from outside: the sandbox cannot)")
                raise SpawnerUnavailable("the holder is stopped")
            return prepared
        raise SpawnerUnavailable("the prepared process died before its command, twice")

    # -- starting a command ---------------------------------------------------------
    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str, stdio: Callable[[], tuple[int, int, int]],
                    shell_command: Optional[str] = None) -> Spawned:
        """Start ``argv`` in a prepared process (already in its job's cgroup: ``Spawned.cgroup``).
        ``stdio`` makes the command's stdin, stdout and stderr, called only where they are
        used: ``shell_command`` is the command, where ``argv`` is ``bash -c`` of it with the
        sandbox's own environment and no stdin, and a prestarted bash may run it instead (then
        ``Spawned.shell`` names the output files it was started with).
        Raises SpawnerUnavailable when it did not start (nothing of it runs then), and what
        ``stdio`` raises (OSError: no descriptors) likewise with nothing started."""
        text = _shell_text(cwd, shell_command) if shell_command is not None and self.shell_env is not None else None
        payload = _encoded(argv, env, cwd) if text is None else None  # too long: refused before a process is taken (but see below)
        self._shell_next = text is not None  # prepare the kind this sandbox's requests need
        prepared = await self._take()
        if prepared.shell is not None and text is not None:
            return self._run_in_shell(prepared, text)
        if prepared.shell is not None:  # a shell, prepared before this kind of request came
            prepared.discard()
            prepared = await self._take()
            if prepared.shell is not None:
                prepared.discard()
                raise SpawnerUnavailable("the spawner prepared a shell for a command it cannot run")
        ctl, spawned = prepared.ctl, prepared.spawned
        try:
            if payload is None:  # a plain process, prepared before this sandbox's requests turned to shells (too long: it is discarded)
                payload = _encoded(argv, env, cwd)
            fds = stdio()
            try:
                ctl.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            except OSError as exc:
                raise SpawnerUnavailable(f"the prepared process is gone: {exc}") from None
            taken = await self._readable(ctl, spawned.exited)
            if not taken:
                spawned.kill()  # first: after this it cannot start the command any more
            try:  # read even when the reader did not fire: "x" may have come after the timeout
                acknowledged = ctl.recv(1) == b"x"
            except OSError:
                acknowledged = False
            if not acknowledged:
                if not taken and not spawned.exited.done():
                    self._unhealthy("a prepared process did not take its command in time")
                raise SpawnerUnavailable("the prepared process did not take its command")
            if not taken:  # it started the command, then we killed it: never run it twice
                self._unhealthy("a prepared process took its command too late")
                raise SpawnerLost("the command's process acknowledged it after the start timeout; it was killed")
        except BaseException:
            prepared.discard()
            raise
        ctl.close()
        self._started(spawned.exited)
        self.prepare()  # the next command's process, while this one runs (not after: a caller's next command would wait for it)
        return spawned

    def _run_in_shell(self, prepared: _Prepared, text: bytes) -> Spawned:
        """Hand a prestarted bash its command: write it, close the pipe it waits on."""
        shell = prepared.shell
        assert shell is not None
        try:
            os.pwrite(shell.text, text, 0)
            for fd in (shell.start.stdout, shell.start.stderr):  # what the sandbox's processes may
                os.ftruncate(fd, 0)  # have written there through /proc while it waited is not its output
            os.close(shell.go)  # from here the command runs
            shell.go = -1
        except OSError as exc:
            prepared.discard()
            raise SpawnerUnavailable(f"could not hand the shell its command: {exc}") from None
        shell.close()
        prepared.ctl.close()
        prepared.spawned.shell = shell.start
        self._started(prepared.spawned.exited)
        self.prepare()
        return prepared.spawned

    async def _hello(self, ours: socket.socket, exited: "asyncio.Future[int]") -> int:
        """The command's pid, as the kernel delivered it with the command's first message."""
        readable = await self._readable(ours, exited)
        if exited.done() and not readable:  # "fail", or the child died before saying who it is
            raise SpawnerUnavailable(str(exited.exception() or "the command died before it started"))
        if not readable:
            self._unhealthy("no answer in time")
            raise SpawnerUnavailable("the spawner did not answer in time")
        try:
            data, ancillary, _, _ = ours.recvmsg(16, socket.CMSG_SPACE(_UCRED.size))
        except OSError as exc:
            raise SpawnerUnavailable(f"no word from the command: {exc}") from None
        for level, kind, value in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and data == b"p":
                pid, _, _ = _UCRED.unpack(value[:_UCRED.size])
                if pid > 0:
                    return pid
        raise SpawnerUnavailable("the command did not start")  # it died before saying who it is

    def _verified(self, pid: int, exited: "asyncio.Future[int]") -> Spawned:
        """Pin ``pid`` with a pidfd and check that it is a process of this sandbox."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise SpawnerUnavailable(f"the command is gone before it started: {exc}") from None
        spawned = Spawned(pid, pidfd, exited, self._loop)
        try:
            inside = pid_namespace(pid) == self.namespace
            signal.pidfd_send_signal(pidfd, 0)  # still the process we looked at
        except OSError:
            spawned.close()
            raise SpawnerUnavailable("the command is gone before it started") from None
        if not inside:
            spawned.close()  # never signal a process outside the sandbox
            self._unhealthy(f"reported pid {pid} outside the sandbox")
            raise SpawnerUnavailable("the spawner's command is not in the sandbox")
        return spawned

    def _watch_end(self, spawned: Spawned) -> None:
        """When the command's pidfd says it ended, give the holder's report a grace period."""
        fd = spawned.pidfd

        def ended() -> None:
            self._loop.remove_reader(fd)
            if not spawned.exited.done():
                self._loop.call_later(REPORT_GRACE, self._overdue, spawned.exited)

        self._loop.add_reader(fd, ended)

    def _overdue(self, exited: "asyncio.Future[int]") -> None:
        if not exited.done():
            exited.set_exception(SpawnerLost("the command ended but the holder never said how"))
            self._unhealthy("no exit report")

    def _unhealthy(self, why: str) -> None:
        """Take no more commands (they go through orchard-enter), drop the waiting process, and
        close once the commands already running have been reported: a preparation that failed
        beside a running command must not take that command's end with it."""
        log.warning("spawner: %s; commands of this sandbox now go through orchard-enter", why)
        self.alive = False
        if self._next is not None:
            self._forget(self._next)
            self._next = None
        if not self._running:
            self.close()

    def _started(self, exited: "asyncio.Future[int]") -> None:
        self._running.add(exited)

        def reported(done: "asyncio.Future[int]") -> None:
            self._running.discard(done)
            if not self.alive and self._reading and not self._running:
                self.close()

        exited.add_done_callback(reported)
