"""A task's starting state, made once and handed out as sandboxes.

``PreparedTask`` creates a sandbox from the task's image, writes the task's files, runs its
setup, and freezes the result as a snapshot. Every rollout of the task, and every grading
run, then starts in a copy-on-write fork of that snapshot: the setup never runs twice and
the repository is never copied. A backend without the snapshot capability gets a fresh
sandbox plus the setup each time (same result, slower), so tasks run on any backend.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import PurePosixPath
from typing import Any, Awaitable, Callable, Optional, TypeVar

from orchard.client.aio import AsyncClient, AsyncSandbox
from orchard.errors import OrchardError, SandboxNotFound, SnapshotNotFound, Unsupported
from orchard.models import Snapshot
from orchard.rollout.loop import exec_timeout
from orchard.tasks import Task

log = logging.getLogger("orchard.rollout")
T = TypeVar("T")


async def finish(step: Awaitable[T]) -> T:
    """``step`` run to its end even when the caller is cancelled meanwhile; the cancellation
    goes on once it has ended (cancelled again while waiting, it runs on by itself)."""
    running = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise


async def made(call: Awaitable[T], undo: Callable[[], Awaitable[None]], what: str) -> T:
    """The result of ``call``, which makes ``what`` under an id its caller chose beforehand.
    A caller cancelled meanwhile, or a call whose outcome is unknown (not a plain refusal),
    leaves nothing behind: once the call has ended, ``undo`` deletes that id (already gone
    is fine) before the cancellation or the error goes on."""
    try:
        return await finish(call)
    except BaseException as exc:
        if not (isinstance(exc, OrchardError) and exc.error_type == "rejected"):
            await finish(_undo(undo, what))
        raise


async def _undo(undo: Callable[[], Awaitable[None]], what: str) -> None:
    try:
        await undo()
    except (SandboxNotFound, SnapshotNotFound):
        pass
    except OrchardError as exc:
        log.warning("deleting %s failed: %s", what, exc)


async def delete_sandbox(sandbox: AsyncSandbox) -> None:
    """Delete ``sandbox`` to the end, cancellation or not; one already gone is fine."""
    await finish(_undo(sandbox.delete, f"sandbox {sandbox.id}"))


class TaskSetupFailed(OrchardError):
    """A task's setup failed (a command exited non-zero): the task is broken, not the policy."""

    status_code = 422
    error_type = "rejected"


class PreparedTask:
    """Sandboxes in a task's starting state (``async with`` cleans up the snapshot)."""

    def __init__(self, client: AsyncClient, task: Task, **sandbox_spec: Any) -> None:
        self.client = client
        self.task = task
        self.sandbox_spec = sandbox_spec  # cpu, memory, disk, block_network, labels... for every sandbox
        self.snapshot: Optional[Snapshot] = None
        self.forks = False  # False: each sandbox is a fresh one plus the setup
        self.grades: dict[str, "asyncio.Future[Any]"] = {}  # applied diff's digest -> its grading (deterministic tests)
        self._lock = asyncio.Lock()
        self._ready = False

    async def __aenter__(self) -> "PreparedTask":
        await self.prepare()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def prepare(self) -> None:
        """Run the setup once and snapshot it (idempotent; concurrent callers wait)."""
        async with self._lock:
            if self._ready:
                return
            sandbox = await self._fresh()
            try:
                snapshot_id = f"snap-{secrets.token_hex(6)}"
                self.snapshot = await made(sandbox.snapshot(snapshot_id),
                                           lambda: self.client.delete_snapshot(snapshot_id), f"snapshot {snapshot_id}")
                self.forks = self._ready = True
            except Unsupported as exc:
                log.info("no snapshots here (%s): every sandbox of %s runs the setup", exc, self.task.task_id)
                self._ready = True
            finally:
                await delete_sandbox(sandbox)  # the snapshot outlives the sandbox it was taken of

    async def sandbox(self, **spec: Any) -> AsyncSandbox:
        """A new sandbox in the task's starting state; the caller deletes it. A caller
        cancelled meanwhile (a straggler cut off) leaves nothing behind."""
        await self.prepare()
        options = {**self.sandbox_spec, **spec}
        if not self.forks:
            return await self._fresh(**options)
        assert self.snapshot is not None
        return await self._create(self.snapshot.image, snapshot=self.snapshot.snapshot_id, **options)

    async def _create(self, image: str, **spec: Any) -> AsyncSandbox:
        """``client.create`` under an id chosen here, so a cancelled or failed call's sandbox
        is deleted rather than left running."""
        sandbox_id = f"sbx-{secrets.token_hex(6)}"
        return await made(self.client.create(image, **{**spec, "sandbox_id": sandbox_id}),
                          lambda: self.client.delete(sandbox_id), f"sandbox {sandbox_id}")

    async def _fresh(self, **spec: Any) -> AsyncSandbox:
        sandbox = await self._create(self.task.image, **{**self.sandbox_spec, **spec})
        try:
            await self._setup(sandbox)
        except BaseException:
            await delete_sandbox(sandbox)
            raise
        return sandbox

    async def _setup(self, sandbox: AsyncSandbox) -> None:
        task = self.task
        workdir = PurePosixPath(task.workdir)
        directories = sorted({str(workdir / PurePosixPath(name).parent) for name in task.files} | {str(workdir)})
        await sandbox.exec(["mkdir", "-p", *directories], check=True, cwd="/")
        for name, text in task.files.items():
            await sandbox.upload(str(workdir / name), text)
        for command in task.setup:
            job = await sandbox.exec(command, cwd=task.workdir,
                                     timeout=exec_timeout(task.command_timeout_seconds, task.task_id))
            if not job.ok:
                raise TaskSetupFailed(f"task {task.task_id}: setup command {command!r} failed "
                                      f"(exit {job.exit_code}, {job.error_type or 'no error'}): "
                                      f"{(job.stderr or job.stdout)[-1000:]}")

    async def close(self) -> None:
        """Delete the snapshot, once gradings still in flight have ended (a rollout cancelled
        while grading leaves its grading running, shared as it is): their sandboxes are gone
        by then, and none of them prepares the task again afterwards. They are waited for, not
        cancelled: a cancellation landing in a grading's own clean-up would leave its sandbox."""
        running = [grading for grading in self.grades.values() if not grading.done()]
        if running:
            await finish(asyncio.wait(running))
        snapshot, self.snapshot, self._ready = self.snapshot, None, False
        if snapshot is not None:
            await finish(_undo(lambda: self.client.delete_snapshot(snapshot.snapshot_id),
                               f"snapshot {snapshot.snapshot_id}"))
