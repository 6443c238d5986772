"""Cgroup trees of agents that died are removed by the next agent; live agents' never.

A Slurm pilot killed with SIGKILL used to leave ``<hierarchy>/orchard/pilot-...`` for good.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchard.agent.cgroup_owners import CgroupOwnership

HOLDER = ("import fcntl, os, sys, time\n"
          "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
          "fcntl.flock(fd, fcntl.LOCK_EX)\n"
          "print('held', flush=True)\n"
          "time.sleep(120)\n")


def _trees(parent: Path, *names: str) -> None:
    for name in names:
        (parent / name / "sbx-1" / "job-0").mkdir(parents=True)


def test_only_trees_whose_owner_is_known_dead_are_removed(tmp_path):
    owners, parent = tmp_path / "owners", tmp_path / "orchard"
    owners.mkdir()
    _trees(parent, "dead", "alive", "unknown", "me")
    (owners / "dead").touch()  # its agent died: nobody holds the lock
    alive = subprocess.Popen([sys.executable, "-c", HOLDER, str(owners / "alive")], stdout=subprocess.PIPE, text=True)
    try:
        assert alive.stdout.readline() == "held\n"
        me = CgroupOwnership("me", owners)
        assert me.hold()
        removed = me.remove_orphans([parent], lambda tree: shutil.rmtree(tree) is None)
        assert removed == ["dead"]
        assert sorted(p.name for p in parent.iterdir()) == ["alive", "me", "unknown"]
        assert sorted(p.name for p in owners.iterdir()) == ["alive", "me"]
        me.release(forget=True)
        assert sorted(p.name for p in owners.iterdir()) == ["alive"]
    finally:
        alive.kill()
        alive.wait()


def test_a_tree_that_cannot_be_removed_keeps_its_lock_file_for_the_next_try(tmp_path):
    owners, parent = tmp_path / "owners", tmp_path / "orchard"
    owners.mkdir()
    _trees(parent, "dead")
    (owners / "dead").touch()
    assert CgroupOwnership("me", owners).remove_orphans([parent], lambda tree: False) == []
    assert (owners / "dead").exists()


def test_a_second_agent_on_the_same_name_does_not_take_the_claim(tmp_path):
    first, second = CgroupOwnership("same", tmp_path), CgroupOwnership("same", tmp_path)
    assert first.hold()
    started = time.monotonic()
    assert not second.hold()  # warned, after waiting for a sweep to let go
    assert time.monotonic() - started >= 4
    first.release()


needs_cgroups = pytest.mark.skipif(os.geteuid() != 0 or not Path("/sys/fs/cgroup/pids/cgroup.procs").exists(),
                                   reason="real v1 cgroups need root")


def _agent_tree(settings) -> list[Path]:
    import hashlib

    digest = hashlib.sha256(str(settings.state_dir.resolve()).encode()).hexdigest()[:10]
    name = f"{settings.state_dir.name}-{digest}"
    return [Path("/sys/fs/cgroup") / c / "orchard" / name for c in ("memory", "pids", "cpu")]


@needs_cgroups
def test_an_agent_killed_with_sigkill_leaves_a_tree_the_next_agent_removes(agent_settings):
    """Agent A (its own state dir) is killed with SIGKILL while it holds a sandbox; agent B,
    on another state dir, removes A's tree when it starts, and leaves a live agent C's alone."""
    from orchard.agent.jobs import process_ended
    from orchard.backends.local.launcher import stop_agent
    from orchard.client import Client

    settings = {name: agent_settings.model_copy(update={"state_dir": Path(f"{agent_settings.state_dir}-owners-{name}")})
                for name in "abc"}
    clients, sandboxes = {}, {}
    try:
        for name in "ac":
            clients[name] = Client(backend="local", backend_settings={"agent": settings[name].model_dump(mode="json")})
            sandboxes[name] = clients[name].create("host")
            sandboxes[name].exec("sleep 1000 &")
        pid_a = json.loads((settings["a"].state_dir / "agent" / "agent.json").read_text())["pid"]
        os.kill(pid_a, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not process_ended(pid_a):  # dead (a zombie until the launcher reaps it)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        tree_a = _agent_tree(settings["a"])
        assert any(t.exists() for t in tree_a)  # left behind
        clients["b"] = Client(backend="local", backend_settings={"agent": settings["b"].model_dump(mode="json")})
        clients["b"].create("host")  # B is up: its start swept
        assert not any(t.exists() for t in tree_a)
        assert all(t.exists() for t in _agent_tree(settings["c"]))
        assert sandboxes["c"].exec("echo alive").stdout == "alive\n"
    finally:
        for name, client in clients.items():
            try:
                client.close()
            except Exception:
                pass
        for name in "abc":
            stop_agent(settings[name])
            shutil.rmtree(settings[name].state_dir, ignore_errors=True)


def test_pilots_trees_are_found_below_their_jobs_and_shared_ones_are_not(tmp_path):
    from orchard.agent.cgroups import orchard_dirs_below

    memory = tmp_path / "memory"
    (memory / "orchard" / "agent-a" / "sbx-1").mkdir(parents=True)  # a shared tree: not below a job
    (memory / "slurm" / "uid_0" / "job_7" / "step_0" / "task_0" / "orchard" / "pilot-x" / "sbx-2").mkdir(parents=True)
    (memory / "slurm" / "uid_0" / "job_8" / "step_0" / "task_0" / "orchard" / "pilot-y" / "orchard").mkdir(parents=True)
    (memory / "system.slice").mkdir()
    found = orchard_dirs_below([memory])
    assert sorted(str(p.relative_to(memory)) for p in found) == [
        "slurm/uid_0/job_7/step_0/task_0/orchard", "slurm/uid_0/job_8/step_0/task_0/orchard"]  # not below a tree
