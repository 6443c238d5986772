"""The agent's snapshot, fork and reset operations (see snapshots.py for what a snapshot is).

A mixin of :class:`~orchard.agent.service.AgentService`: it works on the service's sandboxes,
snapshot store and runtime, and keeps these operations out of the service's own module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from orchard.agent.frozen_layers import layer_usage, seal
from orchard.agent.runtimes.layers import MOUNT_OPTIONS_MAX, fork_options_length
from orchard.agent.runtimes.mounts import remove_tree
from orchard.agent.sandbox import SandboxState
from orchard.agent.snapshots import SnapshotState, SnapshotStore, hand_over
from orchard.errors import OrchardError, QuotaExceeded, RuntimeUnavailable, SandboxConflict, Unsupported
from orchard.models import Sandbox, Snapshot, SnapshotRequest
from orchard.plugins import emit_event

if TYPE_CHECKING:
    from orchard.agent.runtimes.api import IsolationRuntime
    from orchard.agent.settings import AgentSettings

log = logging.getLogger("orchard.agent")


class SnapshotOperations:
    settings: "AgentSettings"
    sandboxes: dict[str, SandboxState]
    snapshots: SnapshotStore
    runtime: Optional["IsolationRuntime"]

    def _ready(self, sandbox_id: str) -> SandboxState:
        raise NotImplementedError

    async def _release(self, sandbox: SandboxState) -> None:
        raise NotImplementedError

    def _holder_exited(self, sandbox: SandboxState, future: "asyncio.Future[int]") -> None:
        raise NotImplementedError

    async def snapshot(self, sandbox_id: str, request: SnapshotRequest) -> Snapshot:
        """Freeze the sandbox's files as a snapshot to fork from. The sandbox goes on from
        the snapshot: its files stay, its processes do not (they are stopped to freeze)."""
        sandbox = self._ready(sandbox_id)
        snapshot_id = request.snapshot_id or f"snap-{secrets.token_hex(6)}"
        taken = self.snapshots.existing(snapshot_id, sandbox_id)
        if taken is not None:
            return taken.to_model()
        assert self.runtime is not None
        if not self.runtime.snapshots or sandbox.host_ids is None:
            raise Unsupported(f"runtime {self.runtime.name!r} cannot snapshot sandboxes"
                              + (" (snapshots need a root agent)" if self.runtime.snapshots else ""))
        self.snapshots.reserve(snapshot_id, sandbox_id, sandbox.base)  # before any await: concurrent calls count it
        try:
            async with sandbox.lock, sandbox.lifecycle:  # between two commands
                self._ready(sandbox_id)
                taken = self.snapshots.existing(snapshot_id, sandbox_id)
                if taken is not None:
                    return taken.to_model()
                snapshot = await self._take_snapshot(sandbox, snapshot_id)
        finally:
            self.snapshots.release(snapshot_id)
        emit_event({"type": "snapshot", "sandbox_id": sandbox_id, "snapshot_id": snapshot_id, "time": time.time()})
        return snapshot.to_model()

    async def _take_snapshot(self, sandbox: SandboxState, snapshot_id: str) -> SnapshotState:
        """Check the limits, then freeze, hand over and seal the layer and restart the
        sandbox on it. A refusal leaves the sandbox as it was; a failure after the freeze
        leaves it lost, never restarting."""
        assert self.runtime is not None and sandbox.placement is not None
        parent = sandbox.base
        self.snapshots.check_depth(parent)  # exact now: this sandbox's earlier snapshots are done
        self._check_forks_fit(1 + (len(parent.layers) if parent is not None else 0))
        directory = self.snapshots.directory / snapshot_id
        if os.path.lexists(directory):
            raise SandboxConflict(f"snapshot id {snapshot_id!r} is still being removed; pick another")
        layer = sandbox.placement.layer
        if layer is not None:
            self.snapshots.reserve_bytes(snapshot_id, await asyncio.to_thread(layer_usage, layer))
        owner = self.runtime.context.images.owner
        assert owner is not None and sandbox.host_ids is not None
        ids = sandbox.host_ids
        sandbox.restarting = True
        try:
            try:
                upper = await self.runtime.freeze(sandbox, directory)
            except Unsupported:
                sandbox.restarting = False  # refused before anything was stopped
                raise
            except Exception as exc:
                await self._restart_failed(sandbox, exc)
                raise
            try:
                upper, size = await asyncio.to_thread(self._seal, directory, upper, ids, owner)
            except Exception as exc:
                await asyncio.to_thread(remove_tree, directory)
                await self._restart_failed(sandbox, exc)
                if isinstance(exc, OrchardError):
                    raise
                raise RuntimeUnavailable(f"snapshot failed: {type(exc).__name__}: {exc}") from exc
            snapshot = SnapshotState(snapshot_id=snapshot_id, sandbox_id=sandbox.sandbox_id, image=sandbox.spec.image,
                                     directory=directory, layers=[upper, *(parent.layers if parent else [])],
                                     parent=parent, size_bytes=size)
            self.snapshots.add(snapshot)
            self.snapshots.use(snapshot, sandbox.sandbox_id)
            if parent is not None:
                self.snapshots.drop(parent, sandbox.sandbox_id)
            sandbox.base = snapshot
            await self._restart(sandbox)
            return snapshot
        finally:
            self._end_restart(sandbox)

    @staticmethod
    def _seal(directory: Path, upper: Path, ids: tuple[int, int], owner: tuple[int, int]) -> tuple[Path, int]:
        """The frozen layer handed to the image owner and made unwritable: (its upper directory,
        its bytes). The overlay's work directory stays: a descriptor kept outside may still
        hold the overlay, and the work directory removed under it would be an orphan, which
        makes the read-only remount fail (EBUSY) as a file open for writing does."""
        size = hand_over(upper, ids, owner)
        return seal(directory, size), size

    def _check_forks_fit(self, layers: int) -> None:
        """Refuse a snapshot whose forks could not mount their overlay (its options must fit
        in a page, with the longest sandbox id), before anything is stopped."""
        needed = fork_options_length(self.settings.sandboxes_dir, layers)
        if needed > MOUNT_OPTIONS_MAX:
            raise QuotaExceeded(f"a fork of this snapshot would stack {layers} layers, and its overlay's mount options "
                                f"({needed} bytes under state_dir {str(self.settings.state_dir)!r}) would not fit in "
                                "a page; fork from an earlier snapshot")

    async def reset(self, sandbox_id: str) -> Sandbox:
        """Start the sandbox again from where it began (its image, or the snapshot it was
        forked from): every file change and every process gone, same id and tokens."""
        sandbox = self._ready(sandbox_id)
        assert self.runtime is not None
        if self.runtime.runs_in_place:
            raise Unsupported(f"runtime {self.runtime.name!r} runs in the agent's own container: it cannot reset it")
        async with sandbox.lock, sandbox.lifecycle:
            self._ready(sandbox_id)
            sandbox.restarting = True
            try:
                try:
                    await self.runtime.stop(sandbox)
                except Exception as exc:
                    await self._restart_failed(sandbox, exc)
                    raise
                await self._restart(sandbox)
            finally:
                self._end_restart(sandbox)
        return sandbox.to_model()

    async def _restart(self, sandbox: SandboxState) -> None:
        """Start a stopped sandbox again on its base (the runtime's start, same ids)."""
        assert self.runtime is not None
        sandbox.placement, sandbox.cgroup, sandbox.holder_exit = None, None, None
        try:
            await self.runtime.start(sandbox)
        except Exception as exc:
            await self._restart_failed(sandbox, exc)
            raise
        if sandbox.holder_exit is not None:
            sandbox.holder_exit.add_done_callback(lambda fut: self._holder_exited(sandbox, fut))
        sandbox.restarting = False

    async def _restart_failed(self, sandbox: SandboxState, exc: BaseException) -> None:
        reason = exc.message if isinstance(exc, OrchardError) else f"{type(exc).__name__}: {exc}"
        sandbox.status, sandbox.status_message = "lost", f"restarting it failed: {reason}"
        sandbox.restarting = False
        log.warning("sandbox %s lost: %s", sandbox.sandbox_id, sandbox.status_message)
        emit_event({"type": "lost", "sandbox_id": sandbox.sandbox_id, "time": time.time(),
                    "reason": sandbox.status_message})
        await self._release(sandbox)

    def _end_restart(self, sandbox: SandboxState) -> None:
        """A snapshot or reset is over, however it ended: the sandbox runs again or is lost,
        never left restarting (an interruption part-way, such as a cancellation, loses it)."""
        if not sandbox.restarting:
            return
        sandbox.restarting = False
        if sandbox.status == "ready":
            sandbox.status, sandbox.status_message = "lost", "restarting it was interrupted"
            log.warning("sandbox %s lost: %s", sandbox.sandbox_id, sandbox.status_message)
            emit_event({"type": "lost", "sandbox_id": sandbox.sandbox_id, "time": time.time(),
                        "reason": sandbox.status_message})
            self._spawn(self._release(sandbox))

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return self.snapshots.get(snapshot_id).to_model()

    def list_snapshots(self) -> list[Snapshot]:
        return self.snapshots.list()

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Forget a snapshot; its files go once no fork uses them."""
        self.snapshots.delete(snapshot_id)

