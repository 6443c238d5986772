"""The holder as a spawner (``spawner: true``): commands forked by the sandbox's PID 1.

Same process state as through orchard-enter; the sandbox cannot stop, signal, ptrace or
reach it, nor the process it forks ahead for the next command; the agent believes nothing
it says without checking; a stopped spawner degrades to orchard-enter; timeouts still kill
the whole tree; no descriptor leaks.
"""

from __future__ import annotations

import array
import asyncio
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from orchard.agent.cgroups import SandboxCgroup
from orchard.agent import spawner as spawner_module
from orchard.agent.spawner import SpawnerClient, SpawnerLost, SpawnerUnavailable

PROBE = ("grep -E '^(Uid|Gid|Groups|Cap[A-Za-z]+|NoNewPrivs|Seccomp|Seccomp_filters):' /proc/self/status; "
         "cat /proc/self/oom_score_adj; pwd; ls /proc/self/fd | wc -l; "
         "for n in /proc/self/ns/*; do basename $n; done; grep pids /proc/self/cgroup | sed 's/job-[0-9]*/job-N/'; "
         "env | grep -v '^ORCHARD_JOB=' | sort; echo ulimit $(ulimit -n) $(ulimit -u); umask")


@pytest.fixture(scope="module")
def spawner_settings(agent_settings):
    return agent_settings.model_copy(update={"state_dir": Path(f"{agent_settings.state_dir}-spawner"), "spawner": True})


@pytest.fixture(scope="module")
def spawner_client(spawner_settings):
    from orchard.backends.local.launcher import stop_agent
    from orchard.client import Client

    client = Client(backend="local", backend_settings={"agent": spawner_settings.model_dump(mode="json")})
    yield client
    client.close()
    stop_agent(spawner_settings)
    shutil.rmtree(spawner_settings.state_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def plain_client(agent_settings):
    """An agent whose commands all go through orchard-enter."""
    from orchard.backends.local.launcher import stop_agent
    from orchard.client import Client

    settings = agent_settings.model_copy(update={"state_dir": Path(f"{agent_settings.state_dir}-plain"), "spawner": False})
    client = Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")})
    yield client
    client.close()
    stop_agent(settings)
    shutil.rmtree(settings.state_dir, ignore_errors=True)


@pytest.fixture
def sandbox(spawner_client):
    handle = spawner_client.create("host")
    yield handle
    handle.delete()


def ppid(handle) -> str:
    return handle.exec("echo $PPID").stdout.strip()


def holder_pid(handle) -> int:
    """The host pid of the sandbox's holder (PID 1 of the namespace shown to the command)."""
    inside = handle.exec("readlink /proc/self/ns/pid").stdout.strip()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"--spawner" not in (entry / "cmdline").read_bytes() or os.readlink(entry / "ns/pid") != inside:
                    continue
                nspid = [line for line in (entry / "status").read_text().splitlines() if line.startswith("NSpid:")]
                if nspid and nspid[0].split()[-1] == "1":
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError("no holder found")


def test_commands_run_in_the_same_state_as_through_orchard_enter(sandbox, plain_client):
    plain = plain_client.create("host")
    try:
        assert ppid(sandbox) == "1"  # forked by the holder
        assert ppid(plain) == "0"  # orchard-enter's child: its parent is outside the PID namespace
        spawned, entered = sandbox.exec(PROBE), plain.exec(PROBE)
        assert spawned.exit_code == 0 and entered.exit_code == 0, (spawned.stderr, entered.stderr)
        assert spawned.stdout == entered.stdout
        assert "CapBnd:\t0000000000000000" in spawned.stdout and "NoNewPrivs:\t1" in spawned.stdout
        assert "Seccomp:\t2" in spawned.stdout and "pids:/job-N" in spawned.stdout
        job = sandbox.exec("cat; echo err >&2; exit 7", stdin="in", env={"A": "b"}, cwd="/tmp")
        assert (job.stdout, job.stderr, job.exit_code) == ("in", "err\n", 7)
        assert sandbox.exec("pwd; echo $A", cwd="/tmp", env={"A": "b"}).stdout == "/tmp\nb\n"
        missing = sandbox.exec("no-such-command")
        assert missing.exit_code == 127
    finally:
        plain.delete()


def test_the_sandbox_cannot_stop_signal_ptrace_or_reach_the_spawner(sandbox):
    job = sandbox.exec("kill -STOP 1; kill -KILL 1; kill -TERM 1; kill -INT 1; echo sent")
    assert job.stdout == "sent\n"
    started = time.monotonic()
    assert ppid(sandbox) == "1" and time.monotonic() - started < 2  # still the spawner, not stopped
    attempts = sandbox.exec(
        "ls /proc/1/fd 2>/dev/null && echo fd-readable; cat /proc/1/environ 2>/dev/null && echo environ-readable; "
        "python3 -c 'import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        "print(\"attach\", libc.ptrace(16, 1, 0, 0), ctypes.get_errno()); "
        "fd = libc.syscall(434, 1, 0); print(\"getfd\", libc.syscall(438, fd, 5, 0), ctypes.get_errno())'")
    assert "fd-readable" not in attempts.stdout and "environ-readable" not in attempts.stdout
    assert "attach -1 1" in attempts.stdout  # EPERM
    assert "getfd -1 1" in attempts.stdout  # pidfd_getfd of the spawner's socket: EPERM (seccomp, ptrace rules)
    assert ppid(sandbox) == "1"


def test_the_holder_holds_no_privileged_descriptors(sandbox):
    pid = holder_pid(sandbox)
    targets = sorted(os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())
    sockets = [t for t in targets if t.startswith("socket:")]
    assert len(sockets) == 1, targets  # its end of the spawner pair, nothing else
    others = [t for t in targets if not t.startswith(("socket:", "anon_inode:", "/memfd:holder-log"))]
    assert others == ["/dev/null"], targets  # no host directory, no other file
    assert Path(f"/proc/{pid}/status").stat().st_uid == 0  # not dumpable: its /proc entries are root's


def _settled_descriptors(*pids: int) -> tuple[int, ...]:
    """Each process's fewest open descriptors over 0.3 s: after a command, the agent and the
    holder prepare the next one's process, holding a few more descriptors for a moment."""
    counts = [[len(os.listdir(f"/proc/{pid}/fd")) for pid in pids]]
    for _ in range(15):
        time.sleep(0.02)
        counts.append([len(os.listdir(f"/proc/{pid}/fd")) for pid in pids])
    return tuple(min(column) for column in zip(*counts))


def test_no_descriptor_leaks_over_1000_commands(sandbox, spawner_settings):
    agent = json.loads((spawner_settings.agent_dir / "agent.json").read_text())["pid"]
    holder = holder_pid(sandbox)
    sandbox.exec("true")
    before = _settled_descriptors(agent, holder)
    for _ in range(1000):
        assert sandbox.exec("true").exit_code == 0
    after = _settled_descriptors(agent, holder)
    assert after[1] == before[1]
    # Connections of the client may come and go (2), and the next command's prestarted bash
    # (7 descriptors) may be ready at one reading and on its way at the other; a leak of one
    # descriptor per command would show 1,000.
    assert after[0] <= before[0] + 2 + 7
    assert ppid(sandbox) == "1"


def _descriptors(ancdata: list) -> list[int]:
    """The descriptors a message carried (SCM_RIGHTS), as a fake holder or child receives them."""
    return [fd for _, _, value in ancdata for fd in array.array("i", value[:len(value) - len(value) % 4])]


def _fake_start(sock: socket.socket, pid: int) -> None:
    """As a holder and its child: take the first request, say the child is ``pid`` (a real
    process of this PID namespace), take its command and acknowledge it."""
    sock.settimeout(10)
    _, ancdata, _, _ = sock.recvmsg(64, socket.CMSG_SPACE(4))
    with socket.socket(fileno=_descriptors(ancdata)[0]) as ctl:
        ctl.sendmsg([b"p"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("iII", pid, 0, 0))])
        ctl.settimeout(10)
        _, command_fds, _, _ = ctl.recvmsg(1024, socket.CMSG_SPACE(12))
        for fd in _descriptors(command_fds):
            os.close(fd)
        ctl.send(b"x")


def _holder_silent_on_the_second_request(sock: socket.socket, pid: int, events: dict) -> None:
    """Start one command (for ``pid``, a real process of this PID namespace), then leave the
    next command's preparation unanswered for longer than START_TIMEOUT, then report the
    command's end, as a holder whose new child the scheduler starved (or the sandbox stopped)."""
    _fake_start(sock, pid)
    data, ancdata, _, _ = sock.recvmsg(64, socket.CMSG_SPACE(4))  # the next command's preparation
    events["next_request"] = data
    held = _descriptors(ancdata)
    time.sleep(spawner_module.START_TIMEOUT + 1)  # its control socket open, never answered
    sock.send(b"exit 1 7")
    events["reported"].set()
    events["done"].wait(10)
    for fd in held:
        os.close(fd)


def test_a_preparation_failing_beside_a_running_command_leaves_that_command_alone(monkeypatch):
    """The next command's process is prepared while a command runs; when that preparation
    fails (no answer in time), the spawner takes no more commands, but the running one still
    gets its end reported, not SpawnerLost (which killed it and lost its output)."""
    import subprocess

    monkeypatch.setattr(spawner_module, "START_TIMEOUT", 2.0)
    command = subprocess.Popen(["sleep", "30"], start_new_session=True)  # stands for the running command
    events = {"reported": threading.Event(), "done": threading.Event()}

    async def main() -> dict:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client = SpawnerClient(ours, os.getpid())
        holder = threading.Thread(target=_holder_silent_on_the_second_request, args=(theirs, command.pid, events))
        holder.start()
        stdio = (os.open("/dev/null", os.O_RDONLY),) * 3
        try:
            spawned = await client.spawn(["true"], {}, "/", lambda: stdio)
            code = await asyncio.wait_for(spawned.exited, spawner_module.START_TIMEOUT + 5)
            taking = client.alive
            await asyncio.sleep(0)
            return {"code": code, "taking": taking, "reading": client._reading}
        finally:
            os.close(stdio[0])
            client.close()
            events["done"].set()
            await asyncio.to_thread(holder.join, 10)
            theirs.close()

    try:
        result = asyncio.run(main())
    finally:
        command.kill()
    assert events["next_request"] == b"2"  # the preparation that went unanswered
    assert result == {"code": 7, "taking": False, "reading": False}  # reported; then retired and closed


def _holder_reporting_after(sock: socket.socket, command: subprocess.Popen, delay: float | None,
                            events: dict) -> None:
    """Start one command (``command``, a real process), and report its end ``delay`` seconds
    after it ended, or never (None): a holder the scheduler starved, or one gone silent."""
    _fake_start(sock, command.pid)
    code = command.wait(10)
    if delay is not None:
        time.sleep(delay)
        sock.send(b"exit 1 %d" % code)
    events["done"].wait(20)


@pytest.mark.parametrize("delay", [1.0, None], ids=["late", "never"])
def test_an_exit_report_is_awaited_for_its_grace_then_the_command_is_lost(monkeypatch, delay):
    """The command's end is seen through its pidfd; the holder's report of its exit code may
    come later (on an overloaded machine it came over 2 s later: session 24). Within
    REPORT_GRACE it is the command's result; a report that never comes fails it as
    SpawnerLost after the grace, never a hang, and the sandbox's commands go the old way."""

    monkeypatch.setattr(spawner_module, "REPORT_GRACE", 5.0)  # 4 s to spare for the late one
    command = subprocess.Popen(["sh", "-c", "sleep 0.2; exit 3"], start_new_session=True)
    events = {"done": threading.Event()}

    async def main() -> tuple[object, float, bool]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client = SpawnerClient(ours, os.getpid())
        holder = threading.Thread(target=_holder_reporting_after, args=(theirs, command, delay, events))
        holder.start()
        stdio = (os.open("/dev/null", os.O_RDONLY),) * 3
        try:
            spawned = await client.spawn(["true"], {}, "/", lambda: stdio)
            started = time.monotonic()
            try:
                outcome: object = await asyncio.wait_for(spawned.exited, 15)
            except SpawnerLost as exc:
                outcome = exc
            return outcome, time.monotonic() - started, client.alive
        finally:
            os.close(stdio[0])
            client.close()
            events["done"].set()
            await asyncio.to_thread(holder.join, 10)
            theirs.close()

    try:
        outcome, waited, alive = asyncio.run(main())
    finally:
        command.kill()
    if delay is not None:
        assert outcome == 3 and alive, (outcome, waited)
    else:
        assert isinstance(outcome, SpawnerLost) and "never said how" in str(outcome)
        assert 5.0 <= waited < 10 and not alive, waited


def _children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def test_the_next_commands_process_is_forked_while_a_command_runs(sandbox):
    """Prepared when a command starts, not when it ends: a caller's next command (a rollout's
    next turn) would otherwise wait for the fork, the hello and the placement."""
    holder = holder_pid(sandbox)
    sandbox.exec("true")
    running = threading.Thread(target=sandbox.exec, args=("sleep 1",))
    running.start()
    seen: set[int] = set()
    deadline = time.monotonic() + 5
    while running.is_alive() and time.monotonic() < deadline:
        seen.add(len(_children(holder)))
        time.sleep(0.01)
    running.join()
    assert 2 in seen, seen  # the command and the process waiting for the next one
    assert len(_children(holder)) == 1


def test_a_timeout_kills_the_whole_tree_and_background_processes_stay(sandbox):
    started = time.monotonic()
    assert sandbox.exec("sleep 1000 &").exit_code == 0
    assert time.monotonic() - started < 5
    job = sandbox.exec("sleep 300 & setsid sleep 301 & (trap '' TERM INT; sleep 302) & sleep 303", timeout=1)
    assert job.exit_code == 124 and job.error_type == "timeout"
    time.sleep(0.3)
    left = sandbox.exec("ps -eo args").stdout
    assert "sleep 1000" in left
    assert not any(f"sleep {n}" in left for n in (300, 301, 302, 303)), left


def test_a_stopped_spawner_degrades_to_orchard_enter(sandbox):
    """A spawner that does not answer (here stopped from the host: the sandbox cannot) costs
    one command a short wait, then commands go through orchard-enter; none hangs or fails."""
    pid = holder_pid(sandbox)
    os.kill(pid, signal.SIGSTOP)
    try:
        # stopped for sure: a signal lands when the holder is next scheduled, and a command that
        # the agent starts just before that runs with nobody left to report its end (CI, loaded)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("T", "t"):
            assert time.monotonic() < deadline, "the holder never stopped"
            time.sleep(0.01)
        started = time.monotonic()
        job = sandbox.exec("echo $PPID; echo ok")
        assert job.exit_code == 0 and job.stdout == "0\nok\n", job
        assert time.monotonic() - started < 10
    finally:
        os.kill(pid, signal.SIGCONT)
    assert ppid(sandbox) == "0"  # the agent gave up on that spawner for good
    assert sandbox.exec("echo still").stdout == "still\n"


def test_a_long_command_goes_through_orchard_enter(sandbox):
    job = sandbox.exec("echo $PPID; : " + "x" * 70_000)
    assert job.exit_code == 0 and job.stdout == "0\n"
    assert ppid(sandbox) == "1"


def test_a_holder_killed_mid_command_is_a_lost_sandbox(spawner_client):
    handle = spawner_client.create("host")
    try:
        pid = holder_pid(handle)
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        job = handle.exec("sleep 30", timeout=20)
        assert job.error_type == "sandbox_lost", job
    finally:
        handle.delete()


# -- the process forked ahead of the next command --------------------------------------

ATTACK = r"""
import ctypes, os, time
time.sleep(0.5)  # the command that started us has ended: the next command's process waits now
libc, me, lines = ctypes.CDLL(None, use_errno=True), os.getpid(), []
holder = open("/proc/1/cmdline", "rb").read()
deadline = time.time() + 8
while not lines and time.time() < deadline:  # the test's own polls take the waiting process now and then
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, me):
            pid = int(name)
            try:
                if open(f"/proc/{pid}/cmdline", "rb").read() != holder:
                    continue  # a command (it exec'd), not a fork of the holder waiting for one
            except OSError:
                continue
            attach = libc.ptrace(16, pid, 0, 0)
            errno = ctypes.get_errno()
            pidfd = libc.syscall(434, pid, 0)
            taken = [libc.syscall(438, pidfd, fd, 0) for fd in range(8)] if pidfd >= 0 else []
            lines.append(f"{pid} attach {attach} {errno} pidfd {pidfd} getfd {max(taken, default=-1)}")
    time.sleep(0.02)
open("/tmp/attack.out", "w").write("\n".join(lines) + "\nend\n")
"""


def test_the_waiting_process_cannot_be_ptraced_or_robbed_of_its_socket(sandbox):
    """Requests with an env of their own: the process waiting between them is the holder's
    fork with its command socket (a prestarted bash, which holds no socket, replaces it for
    plain requests and would leave the attack only a moment in each preparation)."""
    sandbox.upload("/tmp/attack.py", ATTACK)
    own_env = {"ATTACK": "1"}
    assert sandbox.exec("python3 /tmp/attack.py >/dev/null 2>&1 &", env=own_env).exit_code == 0
    deadline = time.monotonic() + 20
    while ("end" not in (report := sandbox.exec("cat /tmp/attack.out 2>/dev/null", env=own_env).stdout)
           and time.monotonic() < deadline):
        time.sleep(0.2)
    lines = [line for line in report.splitlines() if line != "end"]
    assert lines, report  # it found the waiting process
    for line in lines:
        fields = line.split()
        assert fields[2:4] == ["-1", "1"], line  # ptrace attach: EPERM
        assert fields[-1] == "-1", line  # none of its descriptors (its command socket) could be taken
    assert ppid(sandbox) == "1"  # and it still runs the next command


SEIZE = r"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
me, seized, last_pid = os.getpid(), [], os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)
deadline = time.time() + 4
while time.time() < deadline:
    newest = int(os.pread(last_pid, 32, 0))
    for pid in (newest, newest + 1):  # the process being forked now
        if pid != me and libc.ptrace(0x4206, pid, None, None) == 0:  # PTRACE_SEIZE
            time.sleep(0.1)  # a command has exec'd by now; a process prepared for the next one still waits
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    args = handle.read().split(bytes(1))
                seized.append(str(pid) + " " + b" ".join(args).decode(errors="replace"))
            except OSError:
                pass
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
open("/tmp/seize.out", "w").write("\n".join(seized) + "\nend\n")
"""


def test_the_process_prepared_for_the_next_command_is_never_seizable(sandbox):
    """A sandbox process spinning PTRACE_SEIZE on each new pid may attach to commands (its own
    code, after exec), but never to a process prepared for the next command while it still
    waits with its command socket: that one is not dumpable from fork to the last step before exec.
    (Seized that way, it would be the holder's fork, still waiting 0.1 s later.)"""
    sandbox.upload("/tmp/seize.py", SEIZE)
    assert sandbox.exec("python3 /tmp/seize.py >/dev/null 2>&1 &").exit_code == 0
    for _ in range(10):  # commands it seizes may fail (internal): that is its own code, tracing itself
        time.sleep(0.3)
        sandbox.exec("true")
    deadline = time.monotonic() + 10
    while "end" not in (report := sandbox.exec("cat /tmp/seize.out 2>/dev/null").stdout) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert report.endswith("end\n"), report
    assert not [line for line in report.splitlines() if "--hold" in line], report  # the holder's fork, waiting


def test_a_waiting_process_the_sandbox_killed_is_replaced(sandbox):
    assert sandbox.exec("true").exit_code == 0
    assert sandbox.exec("(sleep 0.3; kill -KILL -1) >/dev/null 2>&1 &").exit_code == 0
    time.sleep(1)
    job = sandbox.exec("echo $PPID; echo ok")
    assert (job.exit_code, job.stdout) == (0, "1\nok\n"), job  # run as asked, by a fresh one
    assert ppid(sandbox) == "1"


def test_a_waiting_process_the_sandbox_stopped_is_replaced_without_a_wait(sandbox):
    """Stopped while it waited (the prestarted bash, or a plain prepared child): it would never
    take its command; it is seen stopped before it is handed one, killed and replaced."""
    assert sandbox.exec("(sleep 0.3; kill -STOP -1) >/dev/null 2>&1 &").exit_code == 0
    time.sleep(1)
    started = time.monotonic()
    job = sandbox.exec("echo $PPID; echo ok")
    assert (job.exit_code, job.stdout) == (0, "1\nok\n"), job  # run as asked, by a fresh one
    assert time.monotonic() - started < 2.0  # seen stopped, not waited on (START_TIMEOUT is 10 s)
    assert sandbox.exec("echo still").stdout == "still\n"
    assert ppid(sandbox) == "1"


# -- the agent believes nothing the holder says ----------------------------------------


def _fake_holder(sock: socket.socket, forge: str, received: list) -> None:
    """Answer one request as a hijacked holder would: with a child claiming this (host)
    process's credentials, or with an impossible report."""
    data, ancdata, _, _ = sock.recvmsg(64, socket.CMSG_SPACE(4))
    fds = array.array("i")
    for level, kind, value in ancdata:
        fds.frombytes(value[:len(value) - len(value) % 4])
    ctl = socket.socket(fileno=fds[0])
    if forge == "pid":
        ctl.sendmsg([b"p"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("iII", os.getpid(), 0, 0))])
        ctl.settimeout(5)
        try:
            data, ancdata, _, _ = ctl.recvmsg(64, socket.CMSG_SPACE(16))  # never gets a placement or a command
        except OSError:
            data, ancdata = b"", []
        received.extend([data, *ancdata] if data or ancdata else [])
    elif forge == "report":
        ctl.close()
        sock.send(b"exit " + data + b" 99999")
    ctl.close()


@pytest.mark.parametrize("forge", ["pid", "report"])
def test_a_hijacked_holder_cannot_make_the_agent_act_outside_the_sandbox(tmp_path, forge):
    received: list = []

    async def main() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client = SpawnerClient(ours, os.getpid(), SandboxCgroup(dirs={"pids": tmp_path}, job_controller="pids"))
        client.namespace = (0, 0)  # the "sandbox" is a PID namespace this process is not in
        holder = threading.Thread(target=_fake_holder, args=(theirs, forge, received))
        holder.start()
        stdio = (os.open("/dev/null", os.O_RDONLY),) * 3
        try:
            with pytest.raises((SpawnerUnavailable, SpawnerLost)):
                await client.spawn(["true"], {}, "/", lambda: stdio)
        finally:
            os.close(stdio[0])
            client.close()
            await asyncio.to_thread(holder.join, 5)
            theirs.close()

    asyncio.run(main())
    procs = tmp_path / "job-0" / "cgroup.procs"
    assert not procs.exists() or procs.read_text() == ""  # nothing was moved, nothing signalled
    assert received == []  # no job group's descriptor and no command reached the forged process


def test_a_holder_gone_while_the_process_is_prepared_is_a_typed_refusal_not_a_cancellation(tmp_path):
    """The holder's socket closes while a command waits for its prepared process (the holder
    died): the command hears SpawnerUnavailable (and runs the other way, or reads lost), never
    a CancelledError that would end its job without a result."""
    async def main() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client = SpawnerClient(ours, os.getpid())
        stdio = (os.open("/dev/null", os.O_RDONLY),) * 3
        try:
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, theirs.close)  # the holder goes away before its child says hello
            with pytest.raises(SpawnerUnavailable):
                await client.spawn(["true"], {}, "/", lambda: stdio)
        finally:
            os.close(stdio[0])
            client.close()

    asyncio.run(main())


def _holder_whose_children_die_before_hello(sock: socket.socket, requests: list) -> None:
    """The sandbox kills each prepared process before it says who it is: its control socket
    closes and the holder reports its exit."""
    sock.settimeout(5)
    for _ in range(2):
        try:
            data, ancdata, _, _ = sock.recvmsg(64, socket.CMSG_SPACE(4))
        except OSError:
            return
        for _, _, value in ancdata:
            for fd in array.array("i", value[:len(value) - len(value) % 4]):
                os.close(fd)
        if not data:
            return
        requests.append(data)
        sock.send(b"exit " + data + b" 137")


def test_a_preparation_that_failed_with_nobody_waiting_is_replaced_for_the_next_command():
    async def main() -> list:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client = SpawnerClient(ours, os.getpid())
        requests: list = []
        holder = threading.Thread(target=_holder_whose_children_die_before_hello, args=(theirs, requests))
        holder.start()
        stdio = (os.open("/dev/null", os.O_RDONLY),) * 3
        try:
            client.prepare()  # as after a command
            await asyncio.sleep(0.3)  # its process died before its hello
            with pytest.raises(SpawnerUnavailable):
                await client.spawn(["true"], {}, "/", lambda: stdio)
        finally:
            client.close()
            os.close(stdio[0])
            await asyncio.to_thread(holder.join, 5)
            theirs.close()
        return requests

    assert len(asyncio.run(main())) == 2  # the stale failure was not handed on: one fresh try


def test_a_job_cgroup_being_filled_is_never_handed_out_twice(tmp_path):
    """The next command's process is written into its job group only after it said hello, and
    orchard-enter joins its group after its exec: until then the group is reserved."""
    cgroup = SandboxCgroup(dirs={"pids": tmp_path}, job_controller="pids")
    first = cgroup.job_dir()
    assert first is not None
    (first / "cgroup.procs").write_text("")  # what the kernel shows in an empty group
    assert cgroup.job_dir() == first  # empty and free: reused
    assert cgroup.claim_job_dir() == first
    second = cgroup.job_dir()
    assert second not in (None, first)
    cgroup.release_job_dir(first)
    assert cgroup.job_dir() == first


def _holder_placing(sock: socket.socket, pid: int, procs: Path, mode: str, events: dict) -> None:
    """Answer one request as the holder's child would, for ``pid`` (a real process of this PID
    namespace): say hello, then take the placement ("g" and the group's ``tasks`` file) and
    answer it as ``mode`` says: ``joins`` (after ``delay``), ``lies`` ("g" without joining),
    ``silent`` (no answer), ``killed`` (the sandbox kills it, then its "g" arrives),
    ``killed-after`` ("g", then the kill 20 ms later: missing from the group before it ended).
    ``procs`` stands for the group's thread list (``tasks``): a plain file, written where the
    child would have joined."""
    _, ancdata, _, _ = sock.recvmsg(64, socket.CMSG_SPACE(4))
    with socket.socket(fileno=_descriptors(ancdata)[0]) as ctl:
        ctl.sendmsg([b"p"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("iII", pid, 0, 0))])
        ctl.settimeout(5)
        data, ancdata, _, _ = ctl.recvmsg(16, socket.CMSG_SPACE(4))
        placement = _descriptors(ancdata)
        events["placement"] = (data, len(placement))
        for fd in placement:
            os.close(fd)
        events["asked"].set()
        time.sleep(events.get("delay", 0))
        if mode == "joins":
            procs.write_text(f"{pid}\n")
            procs.with_name("cgroup.procs").write_text(f"{pid}\n")
        if mode == "killed":
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if mode in ("joins", "lies", "killed", "killed-after"):
            ctl.send(b"g")
        if mode == "killed-after":
            time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
        events["done"].wait(10)


def _fake_job_group(tmp_path: Path) -> SandboxCgroup:
    """A directory standing for a v1 pids group with one job group: plain files named as the
    kernel's (``tasks``, handed over and read back; ``cgroup.procs``, read to find a free group)."""
    job = tmp_path / "job-0"
    job.mkdir()
    (job / "cgroup.procs").write_text("")
    (job / "tasks").write_text("")
    return SandboxCgroup(dirs={"pids": tmp_path}, job_controller="pids", job_dirs=[job])


def _prepare_against(tmp_path: Path, mode: str, delay: float = 0.0, close_when_asked: bool = False):
    """Prepare one process against a fake holder (``_holder_placing``); returns what came of it,
    the gaps between the loop's 10 ms ticks meanwhile, what the child was sent, whether the
    spawner stayed usable and the group the next command would get."""
    import subprocess

    waiting = subprocess.Popen(["sleep", "30"], start_new_session=True)  # stands for the prepared child
    cgroup = _fake_job_group(tmp_path)
    events = {"asked": threading.Event(), "done": threading.Event(), "delay": delay}

    async def main() -> dict:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client = SpawnerClient(ours, os.getpid(), cgroup)
        holder = threading.Thread(target=_holder_placing,
                                  args=(theirs, waiting.pid, tmp_path / "job-0" / "tasks", mode, events))
        holder.start()
        loop = asyncio.get_running_loop()
        gaps: list[float] = []
        try:
            client.prepare()
            task = client._next
            assert task is not None
            if close_when_asked:
                await asyncio.to_thread(events["asked"].wait, 5)
                client.close()  # the holder went away mid-placement
            last = loop.time()
            while not task.done():
                await asyncio.sleep(0.01)
                gaps.append(loop.time() - last)
                last = loop.time()
            outcome = "cancelled" if task.cancelled() else (task.exception() or task.result())
            usable = client.alive
        finally:
            client.close()  # discards a prepared process: kills it
            await asyncio.sleep(0)
            events["done"].set()
            await asyncio.to_thread(holder.join, 5)
            theirs.close()
        return {"outcome": outcome, "gaps": gaps, "placement": events.get("placement"), "usable": usable,
                "next_group": cgroup.job_dir()}

    try:
        return asyncio.run(main()), waiting
    finally:
        waiting.kill()


def test_the_prepared_process_joins_its_job_group_itself_without_stalling_the_loop(tmp_path):
    """The child gets the group's ``tasks`` file and moves itself (a thread moving itself
    takes no global lock: no RCU grace period). However long it takes, the agent's loop runs on."""
    result, waiting = _prepare_against(tmp_path, "joins", delay=1.0)
    assert result["placement"] == (b"g", 1)  # "g" and one descriptor
    assert result["outcome"].spawned.pid == waiting.pid
    assert sum(result["gaps"]) >= 1.0 and max(result["gaps"]) < 0.5
    assert result["next_group"] != tmp_path / "job-0"  # taken by the prepared process


@pytest.mark.parametrize("mode", ["lies", "silent"])
def test_a_placement_is_read_back_from_the_group_not_believed(tmp_path, mode, monkeypatch):
    """A child that answers "g" without joining, or never answers, is refused; the spawner is
    dropped for the sandbox (commands go through orchard-enter), the child is killed, and the
    group whose descriptor it held is never handed out again."""
    monkeypatch.setattr(spawner_module, "START_TIMEOUT", 2.0)  # "silent": the fake holder gives up after 5 s
    result, waiting = _prepare_against(tmp_path, mode)
    assert isinstance(result["outcome"], SpawnerUnavailable)
    assert not result["usable"]
    assert waiting.wait(5) == -signal.SIGKILL
    assert result["next_group"] not in (None, tmp_path / "job-0")  # a new group: job-0 is retired


@pytest.mark.parametrize("mode", ["killed", "killed-after"])
def test_a_child_the_sandbox_killed_during_its_placement_is_replaced_not_called_a_liar(tmp_path, mode, monkeypatch):
    """Killed before its "g" arrives, or just after (missing from its group before its pidfd
    reads ended): the preparation fails, its group is retired, and the spawner stays in use.
    (The fake kills 20 ms after its "g", far beyond the kernel's window: the grace is widened
    so a loaded machine cannot make the kill land after it.)"""

    monkeypatch.setattr(spawner_module, "DEATH_GRACE", 2.0)
    result, waiting = _prepare_against(tmp_path, mode)
    assert isinstance(result["outcome"], SpawnerUnavailable), result["outcome"]
    assert "died" in str(result["outcome"])
    assert result["usable"]
    assert waiting.wait(5) == -signal.SIGKILL
    assert result["next_group"] not in (None, tmp_path / "job-0")


def test_a_spawned_process_reads_ended_whatever_its_descriptor_number():
    """An agent holding many sandboxes has descriptors past 1024 (select's limit)."""
    import resource
    import subprocess

    from orchard.agent.spawner import Spawned

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1500:
        pytest.skip(f"the hard descriptor limit ({hard}) allows no descriptor 1500")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    child = subprocess.Popen(["sleep", "30"])
    pidfd = os.pidfd_open(child.pid)
    high = os.dup2(pidfd, 1500)
    loop = asyncio.new_event_loop()
    try:
        spawned = Spawned(child.pid, high, loop.create_future(), loop)
        assert not spawned.ended()
        child.kill()
        deadline = time.monotonic() + 5
        while not spawned.ended() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert spawned.ended()
    finally:
        os.close(high)
        os.close(pidfd)
        loop.close()
        child.wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_placement_cut_short_kills_the_child_before_its_group_is_released(tmp_path):
    """The holder goes away while the child is being placed: the preparation ends, the child
    is killed before its group is released, and that group (its descriptor went out) is retired."""
    result, waiting = _prepare_against(tmp_path, "silent", close_when_asked=True)
    assert result["outcome"] == "cancelled" or isinstance(result["outcome"], SpawnerUnavailable)
    assert waiting.wait(5) == -signal.SIGKILL
    assert result["next_group"] not in (None, tmp_path / "job-0")


STORM = r"""
import os, signal, time
me, kills, last_pid = os.getpid(), 0, os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)

def prepared(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"--hold" in handle.read()  # the holder's fork, before it becomes a command
    except OSError:
        return False

deadline = time.time() + 4
while time.time() < deadline:
    newest = int(os.pread(last_pid, 32, 0))
    for pid in (newest, newest + 1):
        if pid not in (1, me) and prepared(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                kills += 1
            except OSError:
                pass
open("/tmp/storm.out", "w").write(f"{kills}\nend\n")
"""


def _job_groups(handle) -> dict[str, int]:
    """The sandbox's job groups (pids controller, seen from the host) and how many tasks each holds."""
    line = next(x for x in Path(f"/proc/{holder_pid(handle)}/cgroup").read_text().splitlines() if ":pids:" in x)
    sandbox_group = Path("/sys/fs/cgroup/pids") / line.split(":", 2)[2].lstrip("/")
    return {d.name: len((d / "tasks").read_text().split()) for d in sandbox_group.glob("job-*")}


def test_a_sandbox_killing_every_process_prepared_for_it_gets_right_answers_or_its_own_kills(spawner_client):
    """The sandbox kills each fork of its holder the moment it appears (so some die before their
    hello, some mid-placement, some waiting, some after taking their command): every command
    either runs as asked or ends by that SIGKILL (137), never with a wrong answer or an agent
    error; a bystander sandbox is untouched; afterwards nothing lingers in any job group, the
    groups retired on the way are gone, and the sandbox still has its spawner (a child killed
    between joining its group and our look at the group once read as a lying one)."""
    sandbox, bystander = spawner_client.create("host"), spawner_client.create("host")
    try:
        sandbox.upload("/tmp/storm.py", STORM)
        assert sandbox.exec("python3 /tmp/storm.py >/dev/null 2>&1 &").exit_code == 0
        outcomes: dict[int, int] = {}
        deadline = time.monotonic() + 4.5
        while time.monotonic() < deadline:
            job = sandbox.exec("echo $((6 * 7))")
            assert job.error_type is None, job
            assert (job.exit_code, job.stdout) in ((0, "42\n"), (137, "")), job
            outcomes[job.exit_code] = outcomes.get(job.exit_code, 0) + 1
            assert bystander.exec("echo fine").stdout == "fine\n"
        deadline = time.monotonic() + 30
        while "end" not in (report := sandbox.exec("cat /tmp/storm.out 2>/dev/null").stdout):
            assert time.monotonic() < deadline, "the storm never reported"
            time.sleep(0.2)
        assert int(report.split()[0]) > 0, report  # the storm did kill prepared processes
        assert outcomes.get(0, 0) > 0, outcomes
        assert sandbox.exec("echo ok").stdout == "ok\n"
        time.sleep(0.5)  # the last command's end, and the next process's preparation, settle
        groups = _job_groups(sandbox)
        assert sum(groups.values()) <= 1, groups  # at most the process waiting for the next command
        assert len(groups) <= 6, groups  # groups retired on the way were removed, not piled up (35 before)
        assert ppid(sandbox) == "1"  # its own kills did not cost it the spawner
    finally:
        sandbox.delete()
        bystander.delete()
