"""One agent per state directory: a second one refuses to start, and the launcher waits for
a live agent that answers slowly instead of starting another beside it.

Before the lock, a second agent on the same state directory took over the first one's
socket and, at start, wiped the first one's sandboxes as leftovers (a hostile review found
it: the launcher started one whenever ``/health`` took over 2 s on a loaded machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchard.agent.state_lock import LOCK_NAME
from orchard.backends.local.launcher import ensure_agent, running_agent, stop_agent
from orchard.client import Client
from orchard.errors import BackendUnavailable


@pytest.fixture
def settings(agent_settings):
    settings = agent_settings.model_copy(update={"state_dir": Path(f"{agent_settings.state_dir}-lock-{os.getpid()}")})
    yield settings
    stop_agent(settings, timeout=5)
    shutil.rmtree(settings.state_dir, ignore_errors=True)


def _agent_pids(settings) -> list[int]:
    """Processes running an agent on ``settings.state_dir`` (by command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"orchard.agent" in argv and b"--settings-json" in argv:
            if json.loads(argv[argv.index(b"--settings-json") + 1]).get("state_dir") == str(settings.state_dir):
                found.append(int(entry.name))
    return found


def test_a_second_agent_on_the_same_state_dir_refuses_and_takes_nothing(settings):
    client = Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")})
    try:
        sandbox = client.create("host")
        sandbox.exec("sleep 4244 & echo started")
        first = running_agent(settings)
        second = subprocess.run([sys.executable, "-m", "orchard.agent", "--settings-json", settings.model_dump_json()],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert "StateDirInUse" in second.stderr and f"pid {first['pid']}" in second.stderr, second.stderr[-2000:]
        assert running_agent(settings) == first  # its socket and agent.json are untouched
        assert sandbox.exec("echo still here").stdout == "still here\n"
        assert "sleep 4244" in sandbox.exec("ps -eo args").stdout  # its sandbox was not wiped as a leftover
        sandbox.delete()
    finally:
        client.close()


def test_the_launcher_waits_for_a_live_agent_that_answers_slowly(settings):
    first = ensure_agent(settings)
    pid = int(running_agent(settings)["pid"])
    os.kill(pid, signal.SIGSTOP)  # alive, holding its lock, answering nothing: as on an overloaded machine
    found: list = []
    waiter = threading.Thread(target=lambda: found.append(ensure_agent(settings)))
    try:
        waiter.start()
        time.sleep(4)  # past the 2 s /health timeout that used to start a second agent
        assert _agent_pids(settings) == [pid]
    finally:
        os.kill(pid, signal.SIGCONT)
    waiter.join(timeout=60)
    assert found == [first] and _agent_pids(settings) == [pid]


def test_a_killed_agent_leaves_its_lock_to_the_next(settings):
    ensure_agent(settings)
    pid = int(running_agent(settings)["pid"])
    assert (settings.agent_dir / LOCK_NAME).read_text().strip() == str(pid)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid in _agent_pids(settings) and time.monotonic() < deadline:
        time.sleep(0.05)
    ensure_agent(settings)
    successor = int(running_agent(settings)["pid"])
    assert successor != pid and (settings.agent_dir / LOCK_NAME).read_text().strip() == str(successor)


def test_an_agent_started_by_hand_is_waited_for_and_stopped_too(settings):
    """``orchard agent serve`` / ``python -m orchard.agent --state-dir``: no ``--settings-json``
    on its command line; the lock, not the command line, says it is this state dir's agent."""
    settings.make_dirs()
    by_hand = subprocess.Popen([sys.executable, "-m", "orchard.agent", "--state-dir", str(settings.state_dir)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while running_agent(settings) is None:
            assert time.monotonic() < deadline and by_hand.poll() is None, "the agent did not start"
            time.sleep(0.05)
        by_hand.send_signal(signal.SIGSTOP)
        found: list = []
        waiter = threading.Thread(target=lambda: found.append(ensure_agent(settings)))
        waiter.start()
        time.sleep(3)
        by_hand.send_signal(signal.SIGCONT)
        waiter.join(timeout=60)
        assert found and int(running_agent(settings)["pid"]) == by_hand.pid  # that one, not a second
        assert (settings.agent_dir / "agent.json").exists()
        assert stop_agent(settings, timeout=20) and by_hand.wait(10) is not None
        assert not (settings.agent_dir / "agent.json").exists()  # removed on the way out (uvicorn re-raises SIGTERM)
    finally:
        by_hand.send_signal(signal.SIGCONT)
        by_hand.kill()
        by_hand.wait()


def test_a_forged_command_line_at_the_locks_pid_is_neither_waited_for_nor_signalled(settings):
    """Say a pid recorded in agent.lock was reused by another user's process that calls itself an
    agent of this state dir: only the kernel's record of the lock counts."""
    ensure_agent(settings)
    assert stop_agent(settings, timeout=10)
    forged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "orchard.agent",
                               "--settings-json", json.dumps({"state_dir": str(settings.state_dir)})])
    try:
        (settings.agent_dir / LOCK_NAME).write_text(f"{forged.pid}\n")  # as if the old agent's pid were reused
        started = time.monotonic()
        ensure_agent(settings)
        assert time.monotonic() - started < 20  # not the 30 s wait for a slow agent
        assert int(running_agent(settings)["pid"]) != forged.pid
        assert stop_agent(settings, timeout=10)
        assert forged.poll() is None  # never signalled
    finally:
        forged.kill()
        forged.wait()


def test_a_lock_path_that_is_not_a_regular_file_is_a_typed_error(settings):
    settings.make_dirs()
    (settings.agent_dir / LOCK_NAME).mkdir()
    with pytest.raises(BackendUnavailable, match="agent.lock.*not a regular file|agent.lock.*Is a directory"):
        ensure_agent(settings)
