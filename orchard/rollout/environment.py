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
from pathlib import PurePosixPath
from typing import Any, Optional

from orchard.client.aio import AsyncClient, AsyncSandbox
from orchard.errors import OrchardError, Unsupported
from orchard.models import Snapshot
from orchard.tasks import Task

log = logging.getLogger("orchard.rollout")


def _delete_when_made(making: "asyncio.Future[AsyncSandbox]") -> None:
    if not making.cancelled() and making.exception() is None:
        asyncio.ensure_future(making.result().delete())


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
                self.snapshot = await sandbox.snapshot()
                self.forks = True
            except Unsupported as exc:
                log.info("no snapshots here (%s): every sandbox of %s runs the setup", exc, self.task.task_id)
            finally:
                await sandbox.delete()  # the snapshot outlives the sandbox it was taken of
            self._ready = True

    async def sandbox(self, **spec: Any) -> AsyncSandbox:
        """A new sandbox in the task's starting state; the caller deletes it. A caller
        cancelled meanwhile (a straggler cut off) leaves nothing behind: the sandbox is
        deleted as soon as it exists."""
        await self.prepare()
        making = asyncio.ensure_future(self._make({**self.sandbox_spec, **spec}))
        try:
            return await asyncio.shield(making)
        except asyncio.CancelledError:
            making.add_done_callback(_delete_when_made)
            raise

    async def _make(self, options: dict[str, Any]) -> AsyncSandbox:
        if self.forks:
            assert self.snapshot is not None
            [sandbox] = await self.client.fork(self.snapshot, 1, **options)
            return sandbox
        return await self._fresh(**options)

    async def _fresh(self, **spec: Any) -> AsyncSandbox:
        task = self.task
        sandbox = await self.client.create(task.image, **{**self.sandbox_spec, **spec})
        try:
            await self._setup(sandbox)
        except BaseException:
            await asyncio.shield(sandbox.delete())
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
            job = await sandbox.exec(command, cwd=task.workdir, timeout=task.command_timeout_seconds)
            if not job.ok:
                raise TaskSetupFailed(f"task {task.task_id}: setup command {command!r} failed "
                                      f"(exit {job.exit_code}, {job.error_type or 'no error'}): "
                                      f"{(job.stderr or job.stdout)[-1000:]}")

    async def close(self) -> None:
        if self.snapshot is not None:
            try:
                await self.client.delete_snapshot(self.snapshot.snapshot_id)
            except OrchardError as exc:
                log.warning("deleting snapshot %s failed: %s", self.snapshot.snapshot_id, exc)
            self.snapshot = None
        self._ready = False
