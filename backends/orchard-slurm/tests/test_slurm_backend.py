"""The Slurm backend on a real single-node Slurm (slurm/dev-cluster.sh): pilots submitted
with submitit, sandboxes packed onto them, exec straight to the compute node's agent,
scancel of a pilot reported as lost with Slurm's state."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from orchard.client.http import ApiClient
from orchard.models import SandboxSpec
from orchard_slurm.backend import SlurmBackend

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def slurm_cluster():
    result = subprocess.run(["bash", str(REPO / "slurm" / "dev-cluster.sh"), "up"], capture_output=True, text=True)
    assert result.returncode == 0, f"the dev cluster did not come up:\n{result.stderr[-3000:]}"


@pytest.fixture
def backend(slurm_cluster):
    shared = Path(tempfile.mkdtemp(prefix="orchard-slurm-test-", dir="/tmp"))
    shared.chmod(0o755)  # sandbox roots below must be reachable by the sandbox uid
    job_name = f"orchard-test-{os.getpid()}-{time.monotonic_ns() % 100000}"
    made = SlurmBackend.from_settings({"shared_dir": str(shared), "sandboxes_per_pilot": 3, "max_pilots": 2,
                                       "agent_host": "127.0.0.1", "pilot_idle_seconds": 0, "job_name": job_name,
                                       "time_limit_minutes": 10, "min_remaining_minutes": 0})
    yield made
    subprocess.run(["scancel", "-n", job_name], check=False)


def squeue_jobs(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip() and "COMPLETING" not in line]


async def exec_on(backend: SlurmBackend, sandbox_id: str, command: str) -> dict:
    endpoint = await backend.endpoint(sandbox_id)
    api = ApiClient(endpoint.url, endpoint.token)
    try:
        return await api.request("POST", f"/sandboxes/{sandbox_id}/exec", json_body={"command": command, "wait": True})
    finally:
        await api.close()


def test_pilots_pack_sandboxes_run_commands_and_leave_nothing(backend):
    async def scenario() -> None:
        sandboxes = await asyncio.gather(*(backend.create(SandboxSpec()) for _ in range(5)))
        assert sorted(len(p.sandboxes) for p in backend.pilots.values()) == [2, 3]  # two pilots, packed
        assert len({p.job_id for p in backend.pilots.values()}) == 2
        for sandbox in sandboxes:
            job = await exec_on(backend, sandbox.sandbox_id, "echo $(hostname) $((6 * 7))")
            assert job["exit_code"] == 0 and job["stdout"] == f"{sandbox.sandbox_id} 42\n"
        assert {s.sandbox_id for s in await backend.list()} == {s.sandbox_id for s in sandboxes}
        resources = await backend.resources()
        assert resources["pilots"] == 2 and resources["sandboxes"] == 5
        for sandbox in sandboxes:
            await backend.delete(sandbox.sandbox_id)
        await backend.close()

    asyncio.run(scenario())
    deadline = time.monotonic() + 20
    while squeue_jobs(backend.config.job_name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert squeue_jobs(backend.config.job_name) == []


def test_scancel_of_a_pilot_is_reported_lost_with_slurm_state_and_the_pool_recovers(backend):
    async def scenario() -> None:
        victim = await backend.create(SandboxSpec())
        pilot = backend.pilots[backend.owner[victim.sandbox_id]]
        subprocess.run(["scancel", pilot.job_id], check=True)
        started = time.monotonic()
        while (status := await backend.status(victim.sandbox_id)).status != "lost":
            assert time.monotonic() - started < 10, "not reported lost within 10 s"
            await asyncio.sleep(0.2)
        assert f"Slurm job {pilot.job_id}" in status.status_message
        assert "CANCELLED" in status.status_message or "COMPLETING" in status.status_message
        listed = {s.sandbox_id: s for s in await backend.list()}
        assert listed[victim.sandbox_id].status == "lost"

        fresh = await backend.create(SandboxSpec())
        assert backend.owner[fresh.sandbox_id] != pilot.pilot_id
        assert (await exec_on(backend, fresh.sandbox_id, "echo alive"))["stdout"] == "alive\n"
        await backend.delete(fresh.sandbox_id)
        await backend.delete(victim.sandbox_id)
        await backend.close()

    asyncio.run(scenario())
