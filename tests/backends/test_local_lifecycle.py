"""Life cycle of local sandboxes: nothing left behind, lost sandboxes, crashing clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchard.bench.measure import await_processes, count_processes
from orchard.errors import BackendUnavailable, SandboxLost
from tests.backends.test_local_isolation import holder_pid


def mounts_under(path: Path) -> list[str]:
    return [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(path) in line]


def cgroups_named(sandbox_id: str) -> list[str]:
    """Directories ``orchard/<agent>/<sandbox_id>`` anywhere under /sys/fs/cgroup that exist
    once the walk is over (other cgroups come and go while it walks: those are skipped)."""
    found = [os.path.join(parent, sandbox_id) for parent, children, _ in os.walk("/sys/fs/cgroup")
             if sandbox_id in children and Path(parent).parent.name == "orchard"]
    return [path for path in found if os.path.exists(path)]


def test_delete_leaves_no_process_mount_directory_or_cgroup(orchard_client, agent_settings, tmp_path):
    from tests.images import busybox_rootfs

    rootfs = busybox_rootfs(Path(f"/tmp/orchard-lifecycle-{os.getpid()}"))
    try:
        with orchard_client.create() as host_sb, orchard_client.create(str(rootfs), disk="16Mi") as root_sb:
            for sb in (host_sb, root_sb):
                sb.exec("sleep 1000 & sleep 1001 & echo started")
            assert await_processes("sleep 100", 4) >= 4
            assert len(mounts_under(agent_settings.sandboxes_dir)) >= 2
            ids = [host_sb.id, root_sb.id]
            assert all(cgroups_named(sandbox_id) for sandbox_id in ids)  # the walk finds them while they live
        assert count_processes("sleep 1000") == 0 and count_processes("sleep 1001") == 0
        assert mounts_under(agent_settings.sandboxes_dir) == []
        for sandbox_id in ids:
            assert not (agent_settings.sandboxes_dir / sandbox_id).exists()
            # any hierarchy, v1 (memory/orchard/<agent>/<id>) or v2 (orchard/<agent>/<id>), nested or not
            assert not cgroups_named(sandbox_id)
    finally:
        subprocess.run(["rm", "-rf", str(rootfs)])


def test_killed_holder_means_lost_sandbox(orchard_client):
    victim = orchard_client.create()
    neighbour = orchard_client.create()
    try:
        holder = holder_pid(victim)  # before the sleep: commands of one sandbox are serialized
        job_id = victim.submit("sleep 60")
        time.sleep(0.3)
        os.kill(holder, signal.SIGKILL)
        job = victim.wait_job(job_id, timeout=20)
        assert job.error_type == "sandbox_lost" and job.status == "failed"
        with pytest.raises(SandboxLost, match="holder"):
            victim.exec("true")
        assert orchard_client.get(victim.id).info.status == "lost"
        assert neighbour.exec("echo unaffected").stdout == "unaffected\n"
    finally:
        victim.delete()
        neighbour.delete()


def test_sandboxes_outlive_a_crashing_client(orchard_backend_settings):
    """The agent is its own process: a client that dies leaves sandboxes and commands alive."""
    script = textwrap.dedent(f"""
        import os, sys
        from orchard.client import Client
        client = Client(backend_settings={orchard_backend_settings['local']!r})
        sandbox = client.create(sandbox_id="survivor")
        sandbox.submit("sleep 2; echo finished > done.txt")
        print("created", flush=True)
        os._exit(0)  # no cleanup at all
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "created", result.stderr
    from orchard.client import Client

    with Client(backend_settings=orchard_backend_settings["local"]) as client:
        survivor = client.get("survivor")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "finished" not in survivor.exec("cat done.txt 2>/dev/null").stdout:
            time.sleep(0.2)
        assert survivor.exec("cat done.txt").stdout == "finished\n"
        survivor.delete()


def test_missing_bubblewrap_is_a_clear_refusal(tmp_path):
    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import ensure_agent

    state = Path(f"/tmp/orchard-nobwrap-{os.getpid()}")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    old_path = os.environ["PATH"]
    os.environ["PATH"] = f"{fake_bin}:{Path(sys.executable).parent}"
    try:
        with pytest.raises(BackendUnavailable, match="bubblewrap is not installed"):
            ensure_agent(AgentSettings(state_dir=state))
    finally:
        os.environ["PATH"] = old_path
        subprocess.run(["rm", "-rf", str(state)])


def test_direct_runtime_only_by_name():
    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import stop_agent
    from orchard.client import Client

    state = Path(f"/tmp/orchard-direct-{os.getpid()}")
    settings = AgentSettings(state_dir=state, runtime="direct")
    try:
        with Client(backend_settings={"agent": settings.model_dump(mode="json")}) as client:
            with client.create() as sandbox:
                assert sandbox.info.runtime == "direct"
                assert sandbox.exec("echo direct").stdout == "direct\n"
    finally:
        stop_agent(settings)
        subprocess.run(["rm", "-rf", str(state)])


def test_a_state_dir_the_sandbox_uid_cannot_reach_is_refused_naming_it():
    """A state directory below a 0700 one (mktemp -d, a private home): every create used to
    fail deep in bwrap with 503 "Can't find source path"."""
    import tempfile

    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import ensure_agent, stop_agent

    private = Path(tempfile.mkdtemp(prefix="orchard-private-", dir="/tmp"))  # mode 0700
    settings = AgentSettings(state_dir=private / "state")
    try:
        with pytest.raises(BackendUnavailable, match=f"below {private} \\(mode 0700\\).*chmod o\\+x {private}"):
            ensure_agent(settings)
    finally:
        stop_agent(settings)
        subprocess.run(["rm", "-rf", str(private)])


def test_agent_status_lists_every_local_agent(agent_settings, sandbox):
    import json

    listed = subprocess.run([sys.executable, "-m", "orchard.cli", "agent", "status", "--json"], capture_output=True,
                            text=True, check=True).stdout
    assert str(agent_settings.state_dir) in {info["state_dir"] for info in json.loads(listed)}


def test_an_idle_agent_exits_and_the_next_call_starts_another():
    """Every `orchard serve` used to leave its agent running: 17 idle agents after an afternoon."""
    import time

    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import ensure_agent, running_agent, running_agents, stop_agent
    from orchard.client import Client

    state = Path(f"/tmp/orchard-idle-{os.getpid()}")
    settings = AgentSettings(state_dir=state, idle_exit_seconds=3.0)  # 1 s ran out before the listing on a busy machine
    try:
        ensure_agent(settings)
        first = running_agent(settings)
        assert first is not None and str(state) in {info["state_dir"] for info in running_agents()}
        deadline = time.monotonic() + 15
        while running_agent(settings) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running_agent(settings) is None, "an agent with nothing to do kept running"
        with Client(backend_settings={"agent": settings.model_dump(mode="json")}) as client:
            with client.create() as sandbox:
                time.sleep(4.5)  # a sandbox keeps its agent alive, however quiet
                assert sandbox.exec("echo again").stdout == "again\n"
        stopped = subprocess.run([sys.executable, "-m", "orchard.cli", "agent", "stop", "--state-dir", str(state)],
                                 capture_output=True, text=True)
        assert stopped.returncode == 0
    finally:
        stop_agent(settings)
        subprocess.run(["rm", "-rf", str(state)])


def test_stop_agent_stops_an_agent_that_does_not_answer():
    """An agent whose loop is stalled (a hostile command kept it busy; here SIGSTOP) failed the
    health check, so stop_agent took it for gone and left it running with its sandboxes: four
    such agents outlived their tests' state directories in one afternoon."""
    import json

    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import _pid_alive, ensure_agent, stop_agent

    state = Path(f"/tmp/orchard-stalled-{os.getpid()}")
    settings = AgentSettings(state_dir=state)
    try:
        ensure_agent(settings)
        pid = int(json.loads((settings.agent_dir / "agent.json").read_text())["pid"])
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        assert stop_agent(settings, timeout=2.0)
        while _pid_alive(pid) and time.monotonic() - started < 10:
            time.sleep(0.05)
        assert not _pid_alive(pid)
        assert not stop_agent(settings)  # nothing left to stop; a reused pid is never taken for it
    finally:
        stop_agent(settings)
        subprocess.run(["rm", "-rf", str(state)])
