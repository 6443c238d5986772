"""Sandbox cgroups below the agent's own (a Slurm pilot's): the agent leaves its host
cgroup as it found it, so the job's own tree can be removed when the job ends.

Before, every pilot that exited cleanly left ``task_0/orchard`` in each of its Slurm job's
cgroups, and slurmd could not remove the job's tree: 136 such trees on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from orchard.agent.cgroups import SandboxCgroup

V1 = Path("/sys/fs/cgroup")
CONTROLLERS = [c for c in ("memory", "pids", "cpu") if (V1 / c / "cgroup.procs").exists()]

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not CONTROLLERS, reason="needs root and cgroup v1 hierarchies")

AGENT_LIFE = """
import json, os, sys
from pathlib import Path
for procs in sys.argv[1:]:
    Path(procs).write_text(str(os.getpid()))
from orchard.agent.cgroups import CgroupManager
manager = CgroupManager("pilot-test", below_own=True)
group = manager.create("sbx-1", memory=64 << 20, pids=32, cpus=None)
print(json.dumps(sorted(str(d) for d in group.dirs.values())), flush=True)
assert group.remove()
manager.remove_bases()
"""


def test_an_agent_below_its_own_cgroup_leaves_that_cgroup_as_it_found_it():
    job = [V1 / c / f"orchard-test-job-{uuid.uuid4().hex[:12]}" for c in CONTROLLERS]
    for group in job:
        group.mkdir()
    try:
        run = subprocess.run([sys.executable, "-c", AGENT_LIFE, *(str(g / "cgroup.procs") for g in job)],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        made = json.loads(run.stdout)  # the sandbox's cgroups, as the agent made them: below the job's
        assert made and all(any(d.startswith(f"{g}/orchard/pilot-test/") for g in job) for d in made)
        assert [sorted(p.name for p in g.iterdir() if p.is_dir()) for g in job] == [[] for _ in job]
    finally:
        assert SandboxCgroup({g.parent.name: g for g in job}).remove()


KILLED_AGENT = """
import os, sys, time
from pathlib import Path
for procs in sys.argv[2:]:
    Path(procs).write_text(str(os.getpid()))
from orchard.agent.cgroups import CgroupManager
manager = CgroupManager(sys.argv[1], below_own=True)
manager.create("sbx-1", memory=64 << 20, pids=32, cpus=None)
print(" ".join(str(base) for base in manager.shared), flush=True)
time.sleep(600)
"""


def test_the_shared_tree_of_a_killed_agent_below_its_own_cgroup_is_removed_by_the_next_agent():
    """A pilot's memory cgroup is below its job's; its pids tree is at the hierarchy's root
    where the job sets no pids cgroup (Slurm's default here). Killed with SIGKILL, it cannot
    remove that tree: it now claims it, so the next agent to start on the host does."""
    import signal

    from orchard.agent.cgroups import CgroupManager

    constrained = [c for c in CONTROLLERS if c != "pids"]
    if "pids" not in CONTROLLERS or not constrained:
        pytest.skip("needs the pids hierarchy and another")
    job = [V1 / c / f"orchard-test-job-{uuid.uuid4().hex[:12]}" for c in constrained]  # no pids group: "/"
    name = f"pilot-test-{uuid.uuid4().hex[:8]}"
    for group in job:
        group.mkdir()
    agent = subprocess.Popen([sys.executable, "-c", KILLED_AGENT, name, *(str(g / "cgroup.procs") for g in job)],
                             stdout=subprocess.PIPE, text=True)
    try:
        shared = [Path(p) for p in agent.stdout.readline().split()]
        assert shared == [V1 / "pids" / "orchard" / name]
        assert (shared[0] / "sbx-1").is_dir()
        agent.send_signal(signal.SIGKILL)
        agent.wait(30)
        assert shared[0].exists()  # nobody cleaned up
        following = CgroupManager(f"next-{uuid.uuid4().hex[:8]}")
        removed = following.remove_dead_agents_trees()
        following.remove_bases()
        assert name in removed and not shared[0].exists()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if (V1 / "pids" / "orchard" / name).exists():  # a failed run's: nothing of it is left for the next
            assert SandboxCgroup({"pids": V1 / "pids" / "orchard" / name}).remove()
        assert SandboxCgroup({g.parent.name: g for g in job}).remove()
