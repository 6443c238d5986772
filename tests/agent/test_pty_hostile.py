"""Hostile interactive processes: a flood to a reader that never reads, a burst of 100
terminals in one sandbox. The agent's memory stays bounded and it keeps serving."""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import subprocess
import time

import pytest

from tests.agent.test_pty import pty
from tests.conftest import TEST_STATE_DIR


def _agent_rss_kib() -> int:
    pid = json.loads((TEST_STATE_DIR / "agent" / "agent.json").read_text())["pid"]
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:")).split()[1])


def test_a_flood_to_a_reader_that_never_reads(pty_agent, pty_sandbox):
    before = _agent_rss_kib()
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    term.init(["bash", "-c", "while :; do cat /dev/zero | head -c 1048576; done"])
    samples = []
    for _ in range(6):  # the writer blocks once the socket's and the terminal's buffers are full
        time.sleep(0.5)
        samples.append(_agent_rss_kib())
    assert max(samples) - before < 32 * 1024, f"agent RSS grew from {before} KiB: {samples}"
    term.ws.close()  # and the agent still serves others
    other = pty(pty_agent, pty_sandbox["sandbox_id"])
    other.init(["echo", "fine"])
    other.until_output("fine")


def test_a_hundred_terminals_at_once_hit_the_cap(pty_agent, kit_image):
    http = pty_agent[2]
    sid = http.post("/sandboxes", json={"image": kit_image}).json()["sandbox_id"]
    try:
        _hundred(pty_agent, sid)
    finally:
        http.delete(f"/sandboxes/{sid}")


def _hundred(pty_agent, sid: str) -> None:
    def one(_: int) -> dict:
        term = pty(pty_agent, sid)
        term.send(type="init", cmd=["sleep", "30"])
        frame = term.next()
        if frame["type"] == "ready":
            return {"term": term, **frame}
        term.ws.close()
        return frame

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        frames = list(pool.map(one, range(100)))
    ready = [f for f in frames if f["type"] == "ready"]
    refused = [f for f in frames if f["type"] == "error"]
    assert len(ready) == 16 and len(refused) == 84  # max_ptys_per_sandbox's default
    assert all(f["error_type"] == "QuotaExceeded" and "max_ptys_per_sandbox" in f["message"] for f in refused)
    for frame in ready:
        frame["term"].send(type="close")
        assert frame["term"].until_end()["type"] == "exit"
    # the slots come back once they are closed (the supervisor removes them at once)
    term = pty(pty_agent, sid)
    assert term.init(["true"])["type"] == "ready"
    assert term.until_end() == {"type": "exit", "code": 0}


_STALE_GROUP = r"""
import os, signal, sys, time
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
child = os.fork()
if child == 0:
    os.setpgid(0, 0)
    while not os.path.exists("/tmp/stale-go"):
        time.sleep(0.01)
    os._exit(0)
os.setpgid(child, child)
os.tcsetpgrp(1, child)  # the terminal's foreground group: a group that is about to be empty
print("child-ready", flush=True)
os.waitpid(child, 0)
print("group-stale", flush=True)
time.sleep(300)
"""


def _host_pid_of_group_leader(marker: str) -> int:
    """Host pid of the forked child (its own group, not a session leader) running ``marker``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if marker.encode() not in open(f"/proc/{entry}/cmdline", "rb").read():
                continue
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pgrp, session = int(fields[2]), int(fields[3])
        if pgrp == int(entry) and session != int(entry):
            return int(entry)
    raise AssertionError(f"no process of {marker} found")


def test_a_stale_foreground_group_never_gets_a_host_process_signalled(pty_agent, pty_sandbox):
    """The terminal's foreground group is the sandbox's to set: once that group is empty its
    number is free on the host (pid_max is small), and the agent, root outside the sandbox,
    must not signal whatever host process group got it next."""
    sid = pty_sandbox["sandbox_id"]
    marker = f"stale-{secrets.token_hex(4)}"
    term = pty(pty_agent, sid)
    term.init(["python3", "-c", _STALE_GROUP, marker])
    term.until_output("child-ready")
    stale = _host_pid_of_group_leader(marker)
    assert pty_agent[2].post(f"/sandboxes/{sid}/exec", json={"command": "touch /tmp/stale-go"}).status_code == 200
    term.until_output("group-stale")
    victim = None
    for _ in range(200):  # a host process takes the freed number (others may fork in between: retry)
        if os.path.exists(f"/proc/{stale}"):
            pytest.skip(f"another host process took pid {stale} first")
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(stale - 1))
        candidate = subprocess.Popen(["sleep", "60"], start_new_session=True)
        if candidate.pid == stale:
            victim = candidate
            break
        candidate.kill()
        candidate.wait()
    if victim is None:
        pytest.skip(f"could not place a host process on pid {stale} (the machine forks too much)")
    try:
        term.send(type="signal", sig="TERM")  # python, the session leader, ends with it
        assert term.until_end() == {"type": "exit", "code": -15}
        try:  # a signal to it is already delivered; its death takes a moment to show
            victim.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        assert victim.poll() is None, f"the agent signalled host process {stale}: {victim.returncode}"
    finally:
        victim.kill()
        victim.wait()


def test_a_close_frame_is_heard_while_stdin_waits_for_a_process_that_does_not_read(pty_agent, pty_sandbox):
    """The agent's write of stdin blocks while the terminal's input is full; the frames the
    client sends next (a signal, a close) must still reach the process."""
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    term.init(["bash", "-c", "stty -echo; echo quiet; exec sleep 303"])
    term.until_output("quiet")
    term.stdin("y\n" * 100_000)  # whole lines, far more than the terminal's input buffer holds
    term.send(type="signal", sig="TERM")
    assert term.until_end() == {"type": "exit", "code": -15}
