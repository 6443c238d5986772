"""A job that cannot start ends with the error_type of its cause: ``rejected`` for a refusal,
not ``internal``. The runtime here is a TEST DOUBLE whose command line is refused, since no
real runtime refuses a command after its sandbox started."""

from __future__ import annotations

import asyncio
from pathlib import Path

from orchard.agent.jobs import JobRecord, JobRunner
from orchard.agent.reaper import ChildReaper
from orchard.agent.runtimes.api import IsolationRuntime
from orchard.agent.sandbox import Placement, SandboxState
from orchard.errors import AgentUnreachable, InvalidRequest
from orchard.models import ExecRequest, Job, SandboxSpec


class RefusingRuntime(IsolationRuntime):
    name = "refusing"

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def start(self, sandbox: SandboxState) -> None:  # pragma: no cover - never started here
        raise NotImplementedError

    async def stop(self, sandbox: SandboxState) -> None:  # pragma: no cover
        raise NotImplementedError

    def command(self, *args: object, **kwargs: object) -> list[str]:
        raise self.error


def run_refused(error: Exception, tmp_path: Path) -> Job:
    async def scenario() -> Job:
        reaper = ChildReaper()
        reaper.install(asyncio.get_running_loop())
        sandbox = SandboxState(SandboxSpec(), "sbx-1", "refusing", tmp_path, status="ready",
                               placement=Placement(root="/"))
        record = JobRecord(Job(job_id="job-1", sandbox_id="sbx-1", command="true", status="queued", created_at=0.0),
                           ExecRequest(command="true"))
        await JobRunner(reaper, Path("/bin/true"), 1 << 20).run(sandbox, RefusingRuntime(error), record, "/")
        return record.job

    return asyncio.run(scenario())


def test_a_refused_command_is_rejected_and_an_unreachable_cause_says_so(tmp_path):
    rejected = run_refused(InvalidRequest("cwd: no such directory in the sandbox"), tmp_path)
    assert (rejected.status, rejected.error_type) == ("failed", "rejected")
    assert rejected.error == "cwd: no such directory in the sandbox"
    unreachable = run_refused(AgentUnreachable("the pilot's agent went away"), tmp_path)
    assert unreachable.error_type == "agent_unreachable"
    internal = run_refused(RuntimeError("a bug"), tmp_path)
    assert internal.error_type == "internal" and "RuntimeError: a bug" in internal.error


def test_a_holder_exit_already_seen_marks_the_sandbox_lost_before_the_job_is_graded(tmp_path: Path):
    """The exit future can be done while its callback (which marks the sandbox lost) is still
    queued; the job must not be graded in between, or a killed holder reads ``internal``
    (it did, one run in four, when the spawner's socket closed just after the holder was reaped)."""
    from orchard.agent.jobs import settle_holder

    async def scenario() -> str:
        sandbox = SandboxState(spec=SandboxSpec(image="host"), sandbox_id="sb", runtime="t", state_dir=tmp_path)
        sandbox.status, sandbox.placement = "ready", Placement(root="/", holder_pid=1)
        sandbox.holder_exit = asyncio.get_running_loop().create_future()
        sandbox.holder_exit.add_done_callback(lambda _: setattr(sandbox, "status", "lost"))
        sandbox.holder_exit.set_result(-9)  # seen, callback queued, not run
        await settle_holder(sandbox, dying=True)
        return sandbox.status

    assert asyncio.run(scenario()) == "lost"
