"""The Slurm backend on a real single-node Slurm (slurm/dev-cluster.sh): pilots submitted
with submitit, sandboxes packed onto them, exec straight to the compute node's agent,
scancel of a pilot reported as lost with Slurm's state."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest
from pydantic import ValidationError

from orchard.bench.measure import await_processes, count_processes
from orchard.client.http import ApiClient
from orchard.errors import BackendUnavailable
from orchard.models import SandboxSpec
from orchard_slurm.backend import SlurmBackend
from orchard_slurm.slurm import job_states as slurm_job_states

from slurm_testing import run_leaving_no_jobs, slurm_settings, wait_until_no_jobs


@pytest.fixture
def backend(slurm_cluster):
    made = SlurmBackend.from_settings(slurm_settings(sandboxes_per_pilot=3, max_pilots=2, pilot_idle_seconds=0))
    yield made
    subprocess.run(["scancel", "-n", made.config.job_name], check=False)


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
        assert sorted(len(p.sandboxes) for p in backend.pool.pilots.values()) == [2, 3]  # two pilots, packed
        assert len({p.job_id for p in backend.pool.pilots.values()}) == 2
        for sandbox in sandboxes:
            job = await exec_on(backend, sandbox.sandbox_id, "echo $(hostname) $((6 * 7))")
            assert job["exit_code"] == 0 and job["stdout"] == f"{sandbox.sandbox_id} 42\n"
        assert {s.sandbox_id for s in await backend.list()} == {s.sandbox_id for s in sandboxes}
        resources = await backend.resources()
        assert resources["pilots"] == 2 and resources["sandboxes"] == 5
        for sandbox in sandboxes:
            await backend.delete(sandbox.sandbox_id)
        await backend.shutdown()  # its owner stops: idle pilots go
        await backend.close()

    asyncio.run(scenario())
    assert wait_until_no_jobs(backend.config.job_name) == []


def test_scancel_of_a_pilot_is_reported_lost_with_slurm_state_and_the_pool_recovers(backend):
    async def scenario() -> None:
        victim = await backend.create(SandboxSpec())
        pilot = backend.pool.pilots[backend.pool.owner[victim.sandbox_id]]
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
        assert backend.pool.owner[fresh.sandbox_id] != pilot.pilot_id
        assert (await exec_on(backend, fresh.sandbox_id, "echo alive"))["stdout"] == "alive\n"
        await backend.delete(fresh.sandbox_id)
        await backend.delete(victim.sandbox_id)
        await backend.shutdown()  # its owner stops: idle pilots go
        await backend.close()

    asyncio.run(scenario())


def test_pilot_deletes_its_sandboxes_and_stops_on_slurms_warning_signal(backend):
    async def scenario() -> None:
        first, second = [await backend.create(SandboxSpec()) for _ in range(2)]
        pilot = backend.pool.pilots[backend.pool.owner[first.sandbox_id]]
        job = await exec_on(backend, first.sandbox_id, "sleep 4242 & echo started")
        assert (job["status"], job["stdout"]) == ("succeeded", "started\n"), job
        assert await_processes("sleep 4242", 1) == 1
        script = next((backend.config.shared_dir / "submitit" / pilot.job_id).glob("*_submission.sh")).read_text()
        assert f"--signal=USR2@{backend.config.stop_margin_seconds}" in script and "--no-requeue" in script
        assert f"--comment={backend.pool.job_comment}" in script
        subprocess.run(["scancel", "--signal=USR2", pilot.job_id], check=True)  # what Slurm sends before the limit
        started = time.monotonic()
        while (status := await backend.status(second.sandbox_id)).status != "lost":
            assert time.monotonic() - started < 15, "the pilot did not stop"
            await asyncio.sleep(0.2)
        assert "stopped on SIGUSR2" in status.status_message and f"Slurm job {pilot.job_id}" in status.status_message
        assert count_processes("sleep 4242") == 0  # the agent deleted its sandboxes on the way out
        deadline = time.monotonic() + 15  # lost as soon as it said it stops; its job ends right after
        while (await slurm_job_states([pilot.job_id]))[pilot.job_id] not in ("COMPLETED", "COMPLETING"):
            assert time.monotonic() < deadline, "the pilot's job did not end"
            await asyncio.sleep(0.2)
        await backend.shutdown()  # its owner stops: idle pilots go
        await backend.close()

    asyncio.run(scenario())
    assert wait_until_no_jobs(backend.config.job_name) == []


def test_a_restarted_service_adopts_its_pilots_and_cancels_orphans_but_not_other_services_jobs(slurm_cluster):
    settings = slurm_settings(sandboxes_per_pilot=1, max_pilots=2, pilot_idle_seconds=60)
    neighbour_settings = slurm_settings(job_name=settings["job_name"], pilot_idle_seconds=60)  # same name, other dir

    async def scenario() -> None:
        first, neighbour = SlurmBackend.from_settings(settings), SlurmBackend.from_settings(neighbour_settings)
        kept, orphaned = [await first.create(SandboxSpec()) for _ in range(2)]
        other = await neighbour.create(SandboxSpec())
        orphan_pilot = first.pool.pilots[first.pool.owner[orphaned.sandbox_id]]
        for api in [p.api for p in first.pool.pilots.values()]:
            await api.close()  # the service dies without cleaning up ...
        shutil.rmtree(orphan_pilot.directory)  # ... and one pilot's record is lost with it

        restarted = SlurmBackend.from_settings(settings)
        listed = {s.sandbox_id for s in await restarted.list()}
        assert kept.sandbox_id in listed and orphaned.sandbox_id not in listed
        assert restarted.pool.orphans_cancelled == 0  # reading cancels nothing ...
        await restarted.maintain()  # ... the reconciler's housekeeping does
        assert restarted.pool.orphans_cancelled == 1
        assert (await exec_on(restarted, kept.sandbox_id, "echo adopted"))["stdout"] == "adopted\n"
        states = await slurm_job_states([orphan_pilot.job_id])
        assert states[orphan_pilot.job_id] in ("CANCELLED", "COMPLETING")
        assert (await exec_on(neighbour, other.sandbox_id, "echo untouched"))["stdout"] == "untouched\n"
        for backend, sandbox in ((restarted, kept), (neighbour, other)):
            await backend.delete(sandbox.sandbox_id)
            await backend.shutdown()  # its owner stops: idle pilots go
            await backend.close()

    run_leaving_no_jobs(settings["job_name"], scenario)


def test_a_pilot_near_its_real_time_limit_stops_cleanly_on_its_own(slurm_cluster):
    """No scancel here: a 1-minute pilot with a 30 s margin, and Slurm's own timer sends the
    warning (Slurm may send it up to a minute early, so it comes within seconds). When it
    comes before the pilot's agent is even up (seen under load), the pilot still ends on its
    own and the create says why; both ways nothing is left behind."""
    settings = slurm_settings(time_limit_minutes=1, stop_margin_seconds=30, pilot_idle_seconds=600)

    async def scenario() -> None:
        backend = SlurmBackend.from_settings(settings)
        try:
            sandbox = await backend.create(SandboxSpec())
        except BackendUnavailable as exc:
            # the pilot's own word (its stop record), or Slurm's state while it delivers the warning
            assert any(why in exc.message for why in ("signal 2", "SIGUSR2", "SIGNALING")), exc.message
            await backend.shutdown()
            await backend.close()
            return
        started = time.monotonic()
        while (status := await backend.status(sandbox.sandbox_id)).status != "lost":
            assert time.monotonic() - started < 90, "the pilot outlived its time limit"
            await asyncio.sleep(0.5)
        assert "stopped on SIGUSR2" in status.status_message, status.status_message
        await backend.delete(sandbox.sandbox_id)
        await backend.shutdown()  # its owner stops: idle pilots go
        await backend.close()

    run_leaving_no_jobs(settings["job_name"], scenario)


def test_a_pilot_that_never_starts_its_agent_says_why(slurm_cluster):
    """A site mistake (here an agent address that is not the node's) reads as its own error."""
    settings = slurm_settings(agent_host="192.0.2.1", pilot_idle_seconds=0)  # TEST-NET-1: nobody's address

    async def scenario() -> None:
        backend = SlurmBackend.from_settings(settings)
        with pytest.raises(BackendUnavailable, match="before its agent started: OSError: .*Cannot assign requested address"):
            await backend.create(SandboxSpec())
        await backend.shutdown()  # its owner stops: idle pilots go
        await backend.close()

    run_leaving_no_jobs(settings["job_name"], scenario, check=False)


def test_settings_name_what_is_wrong():
    with pytest.raises(ValidationError, match="unknown runtime 'nope'; installed: .*bwrap"):
        SlurmBackend.from_settings({"runtime": "nope"})
    with pytest.raises(ValidationError, match="per-job mode runs bwrap, charliecloud, apptainer"):
        SlurmBackend.from_settings({"mode": "per-job", "runtime": "podman"})
    with pytest.raises(ValidationError, match="partitoin"):
        SlurmBackend.from_settings({"partitoin": "cpu"})


def test_min_pilots_are_one_job_array_kept_warm(slurm_cluster):
    settings = slurm_settings(min_pilots=2, max_pilots=3, sandboxes_per_pilot=2, pilot_idle_seconds=0)

    async def scenario() -> None:
        backend = SlurmBackend.from_settings(settings)
        assert await backend.list() == [] and backend.pool.pilots_submitted == 0  # a read submits nothing
        await backend.maintain()  # what the reconciler does first: the warm pool is submitted
        warm = list(backend.pool.pilots.values())
        assert len(warm) == 2 and len({p.job_id.split("_")[0] for p in warm}) == 1  # one array, two tasks
        assert all("_" in p.job_id for p in warm)
        await asyncio.wait_for(asyncio.gather(*(p.ready.wait() for p in warm)), 60)
        sandboxes = [await backend.create(SandboxSpec()) for _ in range(4)]
        # no pilot start on the way: the four fit the warm two (a wall-clock bound here failed at load 25)
        assert backend.pool.pilots_submitted == 2 and sorted(len(p.sandboxes) for p in warm) == [2, 2]
        assert (await exec_on(backend, sandboxes[-1].sandbox_id, "echo warm"))["stdout"] == "warm\n"
        for sandbox in sandboxes:
            await backend.delete(sandbox.sandbox_id)
        assert len([p for p in backend.pool.pilots.values() if p.alive]) == 2  # idle, but kept: min_pilots
        await backend.close()  # a client closing cancels nothing ...
        states = await slurm_job_states([p.job_id for p in warm])
        assert all(state in ("RUNNING", "PENDING") for state in states.values()), states
        await backend.shutdown()  # ... its owner stopping for good releases the idle pilots

    run_leaving_no_jobs(settings["job_name"], scenario)


def test_a_pilot_slurm_is_signalling_is_said_to_be_stopping_not_to_have_ended(tmp_path):
    """SIGNALING is not an end state: Slurm is delivering the time-limit warning to a job
    that still runs (seen when it comes before the pilot's agent is up)."""
    from orchard_slurm.pool import Pilot

    pilot = Pilot("pilot-s", "7", tmp_path, 0.0, 60.0, state="SIGNALING")
    assert not pilot.alive
    assert "is being signalled by Slurm" in pilot.lost_reason() and "ended" not in pilot.lost_reason()
    pilot.state = "TIMEOUT"
    assert pilot.lost_reason() == "its pilot, Slurm job 7, ended: TIMEOUT"
