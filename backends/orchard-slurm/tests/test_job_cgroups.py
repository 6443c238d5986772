"""Nothing of a sandbox outlives its Slurm job. The dev cluster runs Slurm's cgroup plugins
(proctrack/cgroup, task/cgroup), as real clusters do: when a job ends, Slurm kills whatever
is left in its cgroup. Sandboxes must therefore stay inside the job's cgroup; Podman's
containers used to move to ``libpod_parent``, outside it, and kept running after the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchard.errors import InvalidRequest

from orchard_slurm.runtimes.charliecloud import CharliecloudRuntime
from orchard_slurm.runtimes.podman import PodmanRuntime
from slurm_testing import lost_soon, require, slurm_client, slurm_settings, squeue_jobs, wait_until_no_jobs
from tests.images import busybox_rootfs


def marked_sleepers(mark: str) -> list[str]:
    """Processes that are exactly ``sleep MARK`` (never a longer number that contains it)."""
    out = subprocess.run(["pgrep", "-ax", "-f", f"sleep {mark}"], capture_output=True, text=True).stdout
    return out.splitlines()


def test_the_dev_cluster_tracks_jobs_by_cgroup(slurm_cluster):
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    assert "proctrack/cgroup" in config and "task/cgroup" in config


@pytest.mark.parametrize("runtime", ["bwrap", "charliecloud", "podman"])
@pytest.mark.parametrize("kill", ["job", "agent"])
def test_sandboxes_die_with_their_pilot_job_however_it_ends(slurm_cluster, runtime, kill):
    """``job``: the whole job is SIGKILLed (scancel --signal=KILL --full). ``agent``: only the
    pilot's agent is, and the job then ends on its own; Podman's containers, moved to
    ``libpod_parent`` outside the job's cgroup, used to survive that."""
    if runtime != "bwrap":
        require({"charliecloud": CharliecloudRuntime, "podman": PodmanRuntime}[runtime])
    settings = slurm_settings(runtime=runtime, sandboxes_per_pilot=2, max_pilots=1)
    shared = Path(settings["shared_dir"])
    image = "host" if runtime == "bwrap" else str(busybox_rootfs(shared / "image"))
    mark = str(4000 + time.monotonic_ns() % 5000)
    with slurm_client(settings) as client:
        sandbox = client.create(image)
        sandbox.exec(f"setsid sleep {mark} > /dev/null 2>&1 & echo started")
        deadline = time.monotonic() + 10  # the command returns once the shell is done; `setsid` may not have
        while not marked_sleepers(mark) and time.monotonic() < deadline:  # exec'd `sleep` yet (CI, loaded)
            time.sleep(0.05)
        assert marked_sleepers(mark), "the sandbox's process did not start"
        (job,) = [line.split()[0] for line in squeue_jobs(settings["job_name"])]
        if kill == "job":
            subprocess.run(["scancel", "--signal=KILL", "--full", job], check=True)  # no goodbye
        else:
            (record,) = shared.glob("pilots/*/agent/agent.json")
            os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
        assert wait_until_no_jobs(settings["job_name"], 30) == []
        deadline = time.monotonic() + 15
        while marked_sleepers(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marked_sleepers(mark) == [], f"a {runtime} sandbox outlived its Slurm job"
        assert lost_soon(client, sandbox.id)
        client.delete(sandbox.id)
        # What the killed pilot left below its job's cgroup kept Slurm from removing that cgroup;
        # the next pilot on the node removes it (its claim in /run/orchard/cgroup-owners is free).
        left = [p for p in Path("/sys/fs/cgroup").glob(f"*/slurm*/uid_*/job_{job}/**/orchard/*") if p.is_dir()]
        if runtime == "bwrap" and kill == "agent":  # with the whole job killed, Slurm's cleanup takes it all
            assert left, "the killed pilot left no tree: this check would prove nothing"
        with client.create(image) as fresh:
            assert fresh.exec("echo ok").stdout == "ok\n"
        assert [p for p in left if p.exists()] == [], "a dead pilot's cgroup tree is still there"


def test_a_pilot_jobs_memory_bounds_its_sandboxes(slurm_cluster):
    """Sandbox cgroups used to sit at the top of each hierarchy (``/orchard/...``) with 4 GiB
    each by default: a sandbox used more memory than Slurm gave its whole pilot. They are made
    below the agent's own cgroup now, each with its share of the job's memory, and a limit
    above that share is refused (it would let one sandbox starve its neighbours and the agent)."""
    settings = slurm_settings(sandboxes_per_pilot=2, max_pilots=1, mem_per_pilot_gb=0.5)
    with slurm_client(settings) as client:
        with pytest.raises(InvalidRequest, match="memory: at most 128 MiB per sandbox"):
            client.create("host", memory="4Gi")
        with client.create("host") as sandbox, client.create("host") as neighbour:
            grab = sandbox.exec("python3 -c \"x = bytearray(300 * 2**20); print('allocated')\"", timeout=60)
            assert "allocated" not in grab.stdout and grab.exit_code != 0, grab
            assert sandbox.exec("echo survived").stdout == "survived\n"  # the command lost, not the sandbox
            assert neighbour.exec("python3 -c \"x = bytearray(100 * 2**20); print('fits')\"").stdout == "fits\n"


def test_a_pilot_jobs_memory_bounds_its_podman_containers(slurm_cluster):
    """Podman put its containers in ``libpod_parent``, outside the job's memory cgroup."""
    require(PodmanRuntime)
    settings = slurm_settings(runtime="podman", sandboxes_per_pilot=2, max_pilots=1, mem_per_pilot_gb=0.5)
    image = str(busybox_rootfs(Path(settings["shared_dir"]) / "image"))
    with slurm_client(settings) as client:
        with client.create(image) as sandbox:
            grab = sandbox.exec("head -c 300m /dev/zero | tail > /dev/null && echo allocated", timeout=60)
            assert "allocated" not in grab.stdout and grab.exit_code != 0, grab
            assert sandbox.exec("echo survived").stdout == "survived\n"
