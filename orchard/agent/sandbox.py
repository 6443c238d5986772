"""What the agent knows about one sandbox it hosts."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from orchard.agent.cgroups import SandboxCgroup
from orchard.agent.snapshots import SnapshotState
from orchard.errors import SandboxLost, SandboxNotReady
from orchard.models import Sandbox, SandboxSpec, SandboxStatus


FILE_CALLS_PER_SANDBOX = 16  # at once; more wait (each costs the agent a process and four fds)


def file_calls_per_sandbox(agent_slots: int) -> int:
    """One sandbox's share of the agent's file-call slots: never more than a quarter of
    them, so no one sandbox can hold them all."""
    return min(FILE_CALLS_PER_SANDBOX, max(1, agent_slots // 4))


@dataclass
class Placement:
    """Where a started sandbox lives, as its runtime reports it."""

    root: str  # host path of the sandbox's root directory, for file calls
    target_pid: Optional[int] = None  # whose namespaces commands join (None: run in place)
    holder_pid: Optional[int] = None  # whose exit means the sandbox is lost
    uid: Optional[int] = None  # ids inside the sandbox
    gid: Optional[int] = None
    shell: str = "bash"
    env: dict[str, str] = field(default_factory=dict)
    default_cwd: str = "/"
    mounts: list[Path] = field(default_factory=list)  # host mounts to undo, innermost first
    layer: Optional[Path] = None  # the overlay's writable layer (what a snapshot freezes), if it has one


@dataclass
class SandboxState:
    spec: SandboxSpec
    sandbox_id: str
    runtime: str
    state_dir: Path
    status: SandboxStatus = "pending"
    status_message: Optional[str] = None
    placement: Optional[Placement] = None
    cgroup: Optional[SandboxCgroup] = None
    created_at: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one command at a time
    lifecycle: asyncio.Lock = field(default_factory=asyncio.Lock)  # a snapshot or reset and a delete, one at a time
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)
    deleting: bool = False
    holder_exit: Optional["asyncio.Future[int]"] = None
    file_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(FILE_CALLS_PER_SANDBOX))
    host_ids: Optional[tuple[int, int]] = None  # its own host uid/gid (root agents), from HostIdPool
    incarnation: str = field(default_factory=lambda: secrets.token_hex(8))  # per-sandbox tokens are bound to it
    base: Optional["SnapshotState"] = None  # the snapshot it was forked from (its overlay's lower layers)
    restarting: bool = False  # a snapshot or reset is replacing its holder: the old one's exit is no loss

    def check_ready(self) -> None:
        """Raise the typed error a call gets when the sandbox cannot take it now."""
        sandbox_id = self.sandbox_id
        if self.status == "lost":
            raise SandboxLost(f"sandbox {sandbox_id!r} was lost: {self.status_message}")
        if self.status == "failed":
            raise SandboxNotReady(f"sandbox {sandbox_id!r} failed to start: {self.status_message}")
        if self.status != "ready":
            raise SandboxNotReady(f"sandbox {sandbox_id!r} is {self.status}; wait for it to be ready")
        if self.restarting:
            raise SandboxNotReady(f"sandbox {sandbox_id!r} is restarting (a snapshot or reset); call again when "
                                  "that returns")

    def to_model(self) -> Sandbox:
        spec = self.spec
        return Sandbox(
            sandbox_id=self.sandbox_id, image=spec.image, status=self.status,
            ready=self.status == "ready", status_message=self.status_message,
            block_network=spec.block_network, cpu=spec.cpu, memory=spec.memory, disk=spec.disk,
            pids=spec.pids, labels=spec.labels, runtime=self.runtime, created_at=self.created_at,
            incarnation=self.incarnation,
        )
