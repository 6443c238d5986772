"""The interface every sandbox backend implements, built in or third party.

A backend decides *where* sandboxes live and how agents get there. Commands and
files never go through it: callers talk to the agent at :meth:`Backend.endpoint`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict

from orchard.backends.checks import Check
from orchard.errors import Unsupported
from orchard.models import Sandbox, SandboxSpec, Snapshot, SnapshotRequest

SNAPSHOTS = "snapshots"  # capability: snapshot, fork (create with ``snapshot``), the snapshot routes
RESET = "reset"  # capability: reset a sandbox to where it began


class BackendConfig(BaseModel):
    """Base of backend configs: unknown keys are errors that name the key."""

    model_config = ConfigDict(extra="forbid")


class AgentEndpoint(BaseModel):
    """Where the exec agent serving a sandbox listens: ``http://host:port`` or ``unix:///path``."""

    url: str
    token: Optional[str] = None


class Backend(ABC):
    name: ClassVar[str]
    config_model: ClassVar[type[BackendConfig]] = BackendConfig
    capabilities: ClassVar[frozenset[str]] = frozenset()  # optional features: SNAPSHOTS, RESET

    def __init__(self, config: BackendConfig) -> None:
        self.config = config

    @classmethod
    def from_settings(cls, settings: dict[str, Any] | None = None) -> "Backend":
        return cls(cls.config_model(**(settings or {})))

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """None when this backend can run here, else why not (shown by ``orchard backends``)."""
        return None

    @classmethod
    def doctor(cls, settings: dict[str, Any]) -> list[Check]:
        """What ``orchard doctor --backend NAME`` checks on this machine, each failure with the
        command that fixes it; ``settings`` are the backend's (unvalidated) settings. Backends
        override this with their own probes; by default it reports ``unavailable_reason``."""
        reason = cls.unavailable_reason()
        return [Check(f"{cls.name} backend", reason is None, reason or "available", reason, True)]

    @abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Create a sandbox and wait up to ``spec.timeout`` for it to be ready."""

    @abstractmethod
    async def delete(self, sandbox_id: str) -> None:
        """Delete a sandbox and everything in it; raise SandboxNotFound if unknown."""

    @abstractmethod
    async def list(self) -> list[Sandbox]:
        """Every sandbox this backend has (the reconciler compares it with its records)."""

    @abstractmethod
    async def status(self, sandbox_id: str) -> Sandbox:
        """The sandbox as the backend sees it now (``lost`` with a reason if it died)."""

    @abstractmethod
    async def endpoint(self, sandbox_id: str) -> AgentEndpoint:
        """The agent that serves exec and file calls of this sandbox."""

    def refuse(self, capability: str) -> Unsupported:
        return Unsupported(f"backend {self.name!r} does not support {capability} (its capabilities: "
                           f"{', '.join(sorted(self.capabilities)) or 'none of the optional ones'})")

    async def snapshot(self, sandbox_id: str, request: SnapshotRequest) -> Snapshot:
        """Freeze a sandbox's files for forks (``SNAPSHOTS``). Creating with ``spec.snapshot``
        forks one; a backend with the capability places the fork where its snapshot is."""
        raise self.refuse(SNAPSHOTS)

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        raise self.refuse(SNAPSHOTS)

    async def list_snapshots(self) -> list[Snapshot]:
        return []

    async def delete_snapshot(self, snapshot_id: str) -> None:
        raise self.refuse(SNAPSHOTS)

    async def reset(self, sandbox_id: str) -> Sandbox:
        """Start a sandbox again from its image or snapshot, same id (``RESET``)."""
        raise self.refuse(RESET)

    async def resources(self) -> dict[str, Any]:
        """Capacity and usage, for ``GET /resources``."""
        return {}

    async def maintain(self) -> None:
        """Housekeeping the reconciler runs before each listing (warm pools, orphaned jobs,
        idle capacity); reads (``list``, ``status``) never change anything themselves."""

    async def shutdown(self) -> None:
        """Its owner stops for good (the server, or an SDK client that built it): give back
        capacity that hosts nothing, such as idle pilot jobs. ``close`` alone never does."""

    async def close(self) -> None:
        """Release clients and connections; sandboxes and cluster jobs stay."""
