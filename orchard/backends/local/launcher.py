"""Find the local exec agent, or start one: a detached process that outlives its caller.

Several programs on one machine share one agent per state directory; it is found
through ``agent.json`` and checked with ``/health`` before use.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from orchard import __version__
from orchard.agent.settings import AgentSettings
from orchard.agent.state_lock import LOCK_NAME, lock_holder
from orchard.backends.api import AgentEndpoint
from orchard.errors import BackendUnavailable

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0


def _healthy(address: str, timeout: float = 2.0) -> bool:
    try:
        if address.startswith("unix://"):
            transport = httpx.HTTPTransport(uds=address.removeprefix("unix://"))
            with httpx.Client(transport=transport, timeout=timeout) as client:
                return client.get("http://agent/health").status_code == 200
        return httpx.get(f"{address}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; an exited agent that we started is reaped, not counted."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def running_agent(settings: AgentSettings) -> Optional[dict]:
    info_path = settings.agent_dir / "agent.json"
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return None
    if _pid_alive(int(info["pid"])) and _healthy(info["address"]):
        return info
    return None


def _agent_state_dir(pid: int) -> Optional[str]:
    """The state directory of the local agent running as ``pid`` (None: not an agent)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"orchard.agent" not in argv:
            return None
        if b"--state-dir" in argv:
            return argv[argv.index(b"--state-dir") + 1].decode()
        return json.loads(argv[argv.index(b"--settings-json") + 1])["state_dir"]
    except (OSError, IndexError, KeyError, TypeError, ValueError):
        return None


def _could_be_our_agent(pid: int) -> bool:
    """A process that may be an agent of ours: our user's, in our PID namespace. Any process
    can claim an agent's command line; a sandbox's processes run in a PID namespace of their
    own (and, under a root agent, as another uid), so none of them passes."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return False
        return os.stat(f"/proc/{pid}/ns/pid").st_ino == os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return False


def _private_agent_dir(settings: AgentSettings) -> bool:
    """The state directory's agent/ is a real directory of ours that nobody else can write
    (make_dirs makes it 0700), reached without a path through /proc, such as another
    process's root: what a command line names is never followed into a sandbox's files."""
    try:
        if Path(os.path.realpath(settings.state_dir)).parts[1:2] == ("proc",):
            return False
        info = os.lstat(settings.agent_dir)
    except (OSError, IndexError):
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def running_agents() -> list[dict]:
    """Every local agent running on this machine (found by its command line), with its
    ``agent.json`` and state directory: what `orchard agent status` lists. A candidate is
    checked before anything it names is read or asked: its owner and PID namespace, then
    its state directory, then that agent.json names this very process; only then /health."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not _could_be_our_agent(int(entry.name)):
            continue
        state_dir = _agent_state_dir(int(entry.name))
        if state_dir is None:
            continue
        try:
            settings = AgentSettings(state_dir=state_dir)
            if not _private_agent_dir(settings):
                continue
            info = json.loads((settings.agent_dir / "agent.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("pid") == int(entry.name) and _healthy(str(info.get("address"))):
            found.append({**info, "state_dir": state_dir})
    return found


def ensure_agent(settings: AgentSettings) -> AgentEndpoint:
    """The endpoint of this state directory's agent, starting it if none is running."""
    settings.make_dirs()
    with open(settings.agent_dir / "launch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two programs starting at once get one agent
        info = running_agent(settings)
        if info is None and (pid := lock_holder(settings)) is not None:
            info = _await_slow_agent(settings, pid)  # never start a second agent beside a live one
        if info is not None and info.get("version") != __version__:
            info = _replace_outdated(settings, info)
        if info is None:
            info = _start(settings)
    token = (settings.agent_dir / "token").read_text().strip()
    return AgentEndpoint(url=info["address"], token=token)


def _serving_pid(settings: AgentSettings) -> Optional[int]:
    """The live agent named by ``agent.json``, for a state directory no agent ever locked (one
    of a version before the lock); otherwise only the lock's holder counts."""
    if (settings.agent_dir / LOCK_NAME).exists():
        return None
    try:
        pid = int(json.loads((settings.agent_dir / "agent.json").read_text())["pid"])
    except (OSError, KeyError, TypeError, ValueError):
        return None
    state_dir = _agent_state_dir(pid)  # the pid may have been reused since agent.json was written
    if state_dir is None or Path(state_dir).resolve() != Path(settings.state_dir).resolve() or not _pid_alive(pid):
        return None
    return pid


def _await_slow_agent(settings: AgentSettings, pid: int) -> Optional[dict]:
    """Wait for a live agent that does not answer yet; None once it has let go of its lock
    (it exited: a new one may start)."""
    deadline = time.monotonic() + START_TIMEOUT
    while lock_holder(settings) == pid:
        info = running_agent(settings)
        if info is not None:
            return info
        if time.monotonic() > deadline:
            raise BackendUnavailable(
                f"the agent of {settings.state_dir} (pid {pid}) runs but has not answered /health for "
                f"{START_TIMEOUT:.0f} s; see {settings.agent_dir / 'agent.log'}, or stop it (`orchard agent stop`)")
        time.sleep(0.1)
    return None


def _replace_outdated(settings: AgentSettings, info: dict) -> Optional[dict]:
    """An agent of another Orchard version runs here: stop it if it is idle, else refuse."""
    token = (settings.agent_dir / "token").read_text().strip()
    address = info["address"]
    transport = httpx.HTTPTransport(uds=address.removeprefix("unix://")) if address.startswith("unix://") else None
    with httpx.Client(transport=transport, timeout=5, headers={"X-API-Key": token}) as client:
        base = "http://agent" if transport else address
        sandboxes = client.get(f"{base}/sandboxes").json().get("sandboxes", [])
    if sandboxes:
        raise BackendUnavailable(
            f"an agent of Orchard {info.get('version', '?')} (this is {__version__}) hosts {len(sandboxes)} "
            f"sandboxes in {settings.state_dir}; run `orchard agent stop` (it deletes them) to upgrade")
    stop_agent(settings)
    return None


def _start(settings: AgentSettings) -> dict:
    log_path = settings.agent_dir / "agent.log"
    (settings.agent_dir / "agent.json").unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("ORCHARD_AGENT_TOKEN",)}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "orchard.agent", "--settings-json", settings.model_dump_json()],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=env, close_fds=True)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
            typed = [line for line in tail if line.startswith("orchard.errors.")]
            if typed:  # our own typed error says it all; the traceback stays in the log
                raise BackendUnavailable(f"the local exec agent failed to start: {typed[-1].split(': ', 1)[-1]} "
                                         f"(log: {log_path})")
            raise BackendUnavailable("the local exec agent failed to start:\n" + "\n".join(tail))
        info = running_agent(settings)
        if info is not None:
            return info
        time.sleep(0.05)
    process.kill()
    raise BackendUnavailable(f"the local exec agent did not start within {START_TIMEOUT:.0f}s; see {log_path}")


def stop_agent(settings: AgentSettings, timeout: float = 20.0) -> bool:
    """Stop this state directory's agent (its sandboxes are deleted); False if none ran. One
    that does not answer (its loop stalled) is stopped too, and killed if it outlives
    ``timeout``. Signals go through a pidfd taken while the process held the lock, so a pid
    reused meanwhile is never hit."""
    pid = lock_holder(settings) or _serving_pid(settings)
    if pid is None:
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False  # gone already
    try:
        if pid != (lock_holder(settings) or _serving_pid(settings)):
            return False  # it exited between the look-up and the pidfd: that pid may be another process now
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        if not select.select([pidfd], [], [], timeout)[0]:
            log.warning("the agent of %s did not stop within %gs of SIGTERM; killing it", settings.state_dir, timeout)
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            select.select([pidfd], [], [], 10.0)
    finally:
        os.close(pidfd)
    try:
        os.waitpid(pid, os.WNOHANG)  # an agent this process started is its child: reap it
    except ChildProcessError:
        pass
    return True
