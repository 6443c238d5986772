"""The agent's sweep of the cgroups its deleted sandboxes left behind.

A deleted sandbox whose killed processes have not left its cgroup within the delete's
patience (``holder.CGROUP_REMOVE_PATIENCE``) leaves that cgroup behind. Before, only the
agent's next start or stop removed it, and the sandbox's host ids went to the next sandbox
while its processes were still there. The sweep empties and removes such groups while the
agent runs and frees their host ids after; it never touches a group it did not leave behind
(a review showed a sweep of "every group no sandbox of mine owns" killing the sandboxes of a
second live agent on the same state dir). A sandbox made again under the id of one whose
group is left behind would share that group: it is refused (503 ``SandboxIdBusy``) until
the group is gone.

A process that outlives SIGKILL is made with cgroup v1's freezer: a frozen task does not
die until it is thawed, as a process stuck in the kernel would not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from orchard.agent.settings import AgentSettings
from orchard.backends.local.launcher import ensure_agent, stop_agent
from tests.backends.test_local_lifecycle import cgroups_named

FREEZER = Path("/sys/fs/cgroup/freezer")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the agent's cgroups)")


@pytest.fixture
def sweeping_agent():
    """An HTTP client of an agent of its own that sweeps every 0.2 s."""
    state = Path(f"/tmp/orchard-sweep-{uuid.uuid4().hex[:12]}")
    settings = AgentSettings(state_dir=state, cgroup_sweep_seconds=0.2, idle_exit_seconds=None)
    endpoint = ensure_agent(settings)
    transport = httpx.HTTPTransport(uds=endpoint.url.removeprefix("unix://"))
    with httpx.Client(transport=transport, base_url="http://agent", headers={"X-API-Key": endpoint.token},
                      timeout=120) as http:
        yield http
    stop_agent(settings)
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def frozen_sleep():
    """(process, freezer group): a ``sleep`` in a v1 freezer group of its own, not yet frozen."""
    if not (FREEZER / "cgroup.procs").exists():
        pytest.skip("needs cgroup v1's freezer")
    group = FREEZER / f"orchard-test-frozen-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    process = subprocess.Popen(["sleep", "600"])
    (group / "cgroup.procs").write_text(str(process.pid))
    yield process, group
    (group / "freezer.state").write_text("THAWED")
    process.kill()
    process.wait()
    group.rmdir()


def _wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _create(http: httpx.Client, **fields) -> tuple[str, list[Path]]:
    created = http.post("/sandboxes", json={"image": "host", **fields}).json()
    assert created["status"] == "ready", created
    groups = [Path(p) for p in cgroups_named(created["sandbox_id"])]
    assert groups
    return created["sandbox_id"], groups


def _host_uid(groups: list[Path]) -> int:
    """The host uid the sandbox's processes (its holder) run as."""
    uids = set()
    for group in groups:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            uids.add(int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1]))
    assert uids and max(uids) > 0
    return max(uids)


def test_a_group_a_delete_left_behind_is_removed_and_its_host_ids_freed_after(sweeping_agent, frozen_sleep):
    http = sweeping_agent
    stuck, freezer = frozen_sleep
    first, groups = _create(http)
    first_uid = _host_uid(groups)
    (groups[0] / "cgroup.procs").write_text(str(stuck.pid))  # a process of the sandbox that SIGKILL cannot end yet
    (freezer / "freezer.state").write_text("FROZEN")
    assert _wait_until(lambda: (freezer / "freezer.state").read_text().strip() == "FROZEN", 10)

    assert http.delete(f"/sandboxes/{first}").status_code == 200  # gives up on the group after its patience
    assert groups[0].exists() and stuck.poll() is None
    second, second_groups = _create(http)
    assert _host_uid(second_groups) != first_uid  # the ids stay with the group while its process lives
    again = http.post("/sandboxes", json={"image": "host", "sandbox_id": first})  # would share the group
    assert again.status_code == 503 and again.json()["error"]["type"] == "SandboxIdBusy", again.text
    assert stuck.poll() is None and groups[0].exists()
    time.sleep(1.0)  # five sweeps: the group holds a process that cannot die yet
    assert groups[0].exists()

    (freezer / "freezer.state").write_text("THAWED")  # the pending SIGKILL ends it
    assert _wait_until(lambda: not any(group.exists() for group in groups), 10), "the leftover group is still there"
    assert stuck.wait(10) == -9
    third, third_groups = _create(http, sandbox_id=first)  # the id is free again too
    assert _host_uid(third_groups) == first_uid  # freed once the group was gone (lowest free ids first)
    for sandbox_id in (second, third):  # whole after many sweeps
        run = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "echo alive", "wait": True})
        assert run.json()["stdout"] == "alive\n"
        assert http.delete(f"/sandboxes/{sandbox_id}").status_code == 200


def test_the_sweep_never_touches_a_group_it_did_not_leave_behind(sweeping_agent):
    """Say another agent on the same state dir (started while this one's loop was stalled)
    made it: not ours to kill."""
    http = sweeping_agent
    live, groups = _create(http)
    foreign = [group.parent / f"sbx-foreign-{uuid.uuid4().hex[:8]}" for group in groups]
    for group in foreign:
        group.mkdir()
    other = subprocess.Popen(["sleep", "600"])
    try:
        for group in foreign:
            (group / "cgroup.procs").write_text(str(other.pid))
        time.sleep(1.0)  # five sweeps
        assert other.poll() is None and all(group.exists() for group in foreign)
    finally:
        other.kill()
        other.wait()
        for group in foreign:
            _wait_until(lambda: not (group / "cgroup.procs").read_text().strip(), 10)
            group.rmdir()
    assert http.delete(f"/sandboxes/{live}").status_code == 200


def test_the_sweep_interval_is_validated():
    with pytest.raises(ValueError, match="cgroup_sweep_seconds"):
        AgentSettings(cgroup_sweep_seconds=0)


def test_a_lost_sandbox_deleted_before_its_group_empties_gives_back_its_host_ids(sweeping_agent, frozen_sleep):
    """Lost (its holder killed) with a process stuck in its group, then deleted: the group is
    left behind twice, once without the ids (already handed over); they must still come back
    when the group goes (a review found them leaked: the next sandbox of that id got others)."""
    http = sweeping_agent
    stuck, freezer = frozen_sleep
    first, groups = _create(http)
    first_uid = _host_uid(groups)
    others = [int(pid) for pid in (groups[0] / "cgroup.procs").read_text().split()]
    (groups[0] / "cgroup.procs").write_text(str(stuck.pid))
    (freezer / "freezer.state").write_text("FROZEN")
    assert _wait_until(lambda: (freezer / "freezer.state").read_text().strip() == "FROZEN", 10)
    for pid in others:  # the holder and its processes: the sandbox is lost
        os.kill(pid, signal.SIGKILL)
    assert _wait_until(lambda: http.get(f"/sandboxes/{first}").json()["status"] == "lost", 30)
    assert http.delete(f"/sandboxes/{first}").status_code == 200
    assert groups[0].exists() and stuck.poll() is None

    (freezer / "freezer.state").write_text("THAWED")
    assert _wait_until(lambda: not any(group.exists() for group in groups), 30), "the leftover group is still there"
    again, again_groups = _create(http, sandbox_id=first)
    assert _host_uid(again_groups) == first_uid
    assert http.delete(f"/sandboxes/{again}").status_code == 200
