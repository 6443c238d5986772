"""The base of every backend whose sandboxes live on exec agents (local, remote-agent,
Slurm pilots, Slurm per-job, Kubernetes).

Such a backend answers one question, *where does this sandbox's agent live?*, through
its placement hooks (``place``, ``locate``, ``sites``, ``release``). Everything else is
the same for all of them and lives here once: forwarding life-cycle calls to the agent,
marking what comes back with the backend's name, reporting sandboxes whose agent is gone
as ``lost`` with the reason, and believing an agent only about the sandboxes placed on it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import quote

from orchard.backends.api import RESET, SNAPSHOTS, AgentEndpoint, Backend, BackendConfig
from orchard.client.http import ApiClient
from orchard.errors import AgentUnreachable, BackendUnavailable, InvalidRequest, OrchardError, SandboxLost, SnapshotNotFound
from orchard.models import Sandbox, SandboxSpec, Snapshot, SnapshotRequest

log = logging.getLogger("orchard.backends")


def _segment(value: str) -> str:
    """An id as one URL path segment: '/', '#' and '?' never address another resource, and
    '.' or '..' (which URLs normalize away, encoded or not) are refused."""
    if value in ("", ".", ".."):
        raise InvalidRequest(f"{value!r} is not an id")
    return quote(value, safe="")


@dataclass
class AgentSite:
    """One agent that hosts sandboxes, as a placement hook reports it.

    ``placed`` is the set of sandboxes put there, when the agent may be shared with other
    users or with hostile code (a per-job container, a pod): its listing is believed only
    about those. ``None`` means the agent is this backend's alone. ``lost`` says why the
    agent is gone (its job ended, its pod was evicted); its sandboxes are then ``lost``.
    """

    key: str
    api: Optional[ApiClient]
    endpoint: Optional[AgentEndpoint]
    placed: Optional[set[str]] = None
    lost: Optional[str] = None


class AgentBackedBackend(Backend):
    """Forwards sandbox life cycles to the agent its placement hooks name."""

    create_grace_seconds = 30.0  # on top of the sandbox's own start timeout

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._creating: dict[str, asyncio.Lock] = {}  # sandbox id -> its create in flight
        self._snapshot_sites: dict[str, str] = {}  # snapshot id -> key of the site that keeps it

    def start_timeout(self, spec: SandboxSpec) -> float:
        """How long the agent may take to start this sandbox (``spec.timeout`` when given)."""
        return spec.timeout or 60.0

    # -- placement hooks ---------------------------------------------------------------
    @abstractmethod
    async def place(self, spec: SandboxSpec) -> AgentSite:
        """An agent for a new sandbox (starting one if needed), with the sandbox reserved on it."""

    @abstractmethod
    async def locate(self, sandbox_id: str) -> AgentSite:
        """The agent of a known sandbox (``lost`` set if it is gone); SandboxNotFound if unknown."""

    @abstractmethod
    async def sites(self) -> list[AgentSite]:
        """Every agent this backend uses now, for listings (read only: starts nothing)."""

    async def placed(self, sandbox_id: str) -> Optional[AgentSite]:
        """The agent a sandbox was already placed on, if this backend keeps placements: a create
        repeated with the same id goes there (the agent answers: idempotent, or a conflict)."""
        return None

    async def place_fork(self, spec: SandboxSpec, site: AgentSite) -> AgentSite:
        """``site`` (which keeps the snapshot ``spec`` forks) with the new sandbox reserved on
        it. Backends with the ``snapshots`` capability implement this."""
        raise self.refuse(SNAPSHOTS)

    async def release(self, site: AgentSite, sandbox_id: str, *, failed: bool = False) -> None:
        """The sandbox left ``site`` (deleted, or ``failed`` to start): free what held it."""

    async def recheck(self, site: AgentSite) -> AgentSite:
        """``site``'s agent stopped answering: look again (did its job or pod end?)."""
        return site

    def agent_spec(self, spec: SandboxSpec) -> SandboxSpec:
        """What the agent is asked to create (a per-job agent runs its container in place)."""
        return spec

    async def forward(self, site: AgentSite, method: str, path: str, **kwargs: Any) -> Any:
        """One call to ``site``'s agent (the local backend restarts a dead agent here)."""
        if site.api is None:
            raise SandboxLost(site.lost or f"agent {site.key} has no address")
        return await site.api.request(method, path, **kwargs)

    # -- what comes back -------------------------------------------------------------------
    def answered(self, body: dict[str, Any], spec: Optional[SandboxSpec] = None) -> Sandbox:
        """An agent's sandbox, as this backend reports it."""
        extra: dict[str, Any] = {"backend": self.name}
        if spec is not None:
            extra["image"] = spec.image  # the image asked for (a per-job agent saw 'host')
        return Sandbox(**{**body, **extra})

    def lost_sandbox(self, sandbox_id: str, site: AgentSite) -> Sandbox:
        return Sandbox(sandbox_id=sandbox_id, image="unknown", status="lost", status_message=site.lost or "lost",
                       backend=self.name)

    # -- the Backend interface ---------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Creates with the same id run one at a time: a second waits, then finds the first's
        placement (idempotent, or a conflict), and can never undo it."""
        spec = spec.model_copy(update={"sandbox_id": spec.sandbox_id or f"sbx-{secrets.token_hex(6)}"})
        sandbox_id = str(spec.sandbox_id)
        lock = self._creating.setdefault(sandbox_id, asyncio.Lock())
        try:
            async with lock:
                return await self._create(spec)
        finally:
            if not lock.locked() and self._creating.get(sandbox_id) is lock:
                del self._creating[sandbox_id]

    async def _create(self, spec: SandboxSpec) -> Sandbox:
        site = await self.placed(str(spec.sandbox_id))
        fresh = site is None
        if site is None and spec.snapshot is not None:
            site = await self.place_fork(spec, await self._snapshot_site(spec.snapshot))
        elif site is None:
            site = await self.place(spec)
        try:
            if site.lost is not None:
                raise SandboxLost(f"sandbox {spec.sandbox_id!r} cannot start: {site.lost}")
            try:
                body = await self.forward(site, "POST", "/sandboxes", json_body=self.agent_spec(spec).model_dump(),
                                          timeout=self.start_timeout(spec) + self.create_grace_seconds)
            except AgentUnreachable as exc:  # its job or pod may have ended under the create: say why
                try:
                    lost = (await self.recheck(site)).lost
                except Exception:  # the scheduler cannot say either: the agent's error stands
                    raise exc from None
                if lost is None:
                    raise
                # Sent again, the create is placed afresh (this placement is released below).
                raise BackendUnavailable(f"sandbox {spec.sandbox_id!r} could not start: {lost}",
                                         retryable=True) from exc
        except BaseException:
            if fresh:  # a repeated create never undoes the first one's placement
                await self.release(site, str(spec.sandbox_id), failed=True)
            raise
        return self.answered(body, spec)

    async def delete(self, sandbox_id: str) -> None:
        site = await self.locate(sandbox_id)
        try:
            if site.lost is None:
                await self.forward(site, "DELETE", f"/sandboxes/{_segment(sandbox_id)}")
        finally:
            await self.release(site, sandbox_id)

    async def status(self, sandbox_id: str) -> Sandbox:
        site = await self.locate(sandbox_id)
        if site.lost is not None:
            return self.lost_sandbox(sandbox_id, site)
        try:
            return self.answered(await self.forward(site, "GET", f"/sandboxes/{_segment(sandbox_id)}"))
        except AgentUnreachable:
            site = await self.recheck(site)  # the agent went away: ask the scheduler why, now
            if site.lost is not None:
                return self.lost_sandbox(sandbox_id, site)
            raise

    async def list(self) -> list[Sandbox]:
        found: list[Sandbox] = []
        for site in await self.sites():
            if site.lost is not None:
                found += [self.lost_sandbox(sandbox_id, site) for sandbox_id in sorted(site.placed or ())]
            else:
                found += await self._listed_by(site)
        return found

    async def _listed_by(self, site: AgentSite) -> list[Sandbox]:
        """What one agent says it hosts. A shared agent is believed only about sandboxes placed
        on it (hostile code in its container could claim, or report lost, a neighbour's); an
        unreadable answer from it keeps its sandboxes as they were instead of failing the listing."""
        try:
            body = await self.forward(site, "GET", "/sandboxes")
            items = [self.answered(item) for item in body["sandboxes"]]
        except (OrchardError, ValueError, TypeError, KeyError, RecursionError) as exc:
            if site.placed is None:
                raise
            log.warning("agent %s answered its listing unreadably: %s", site.key, exc)
            return [Sandbox(sandbox_id=sandbox_id, image="", status="ready", ready=True, backend=self.name)
                    for sandbox_id in sorted(site.placed)]
        if site.placed is None:
            return items
        strangers = [item.sandbox_id for item in items if item.sandbox_id not in site.placed]
        if strangers:
            log.warning("agent %s listed sandboxes placed elsewhere (ignored): %s", site.key, strangers[:5])
        return [item for item in items if item.sandbox_id in site.placed]

    async def endpoint(self, sandbox_id: str) -> AgentEndpoint:
        site = await self.locate(sandbox_id)
        if site.lost is not None or site.endpoint is None:
            raise SandboxLost(f"sandbox {sandbox_id!r} is lost: {site.lost or 'its agent has no address'}")
        return site.endpoint

    # -- snapshots (backends with the SNAPSHOTS capability, whose agents are trusted: a
    # per-job container's or a pod's agent shares its sandbox and never gets these calls) --
    async def _snapshot_site(self, snapshot_id: str) -> AgentSite:
        """The site keeping a snapshot: remembered from its creation, else asked around
        (this backend was rebuilt since)."""
        if SNAPSHOTS not in self.capabilities:
            raise self.refuse(SNAPSHOTS)
        key = self._snapshot_sites.get(snapshot_id)
        sites = [site for site in await self.sites() if site.lost is None]
        for site in sorted(sites, key=lambda site: site.key != key):
            try:
                await self.forward(site, "GET", f"/snapshots/{_segment(snapshot_id)}")
            except (SnapshotNotFound, AgentUnreachable):
                continue
            self._snapshot_sites[snapshot_id] = site.key
            return site
        self._snapshot_sites.pop(snapshot_id, None)
        raise SnapshotNotFound(f"snapshot {snapshot_id!r} not found")

    def _snapshot(self, body: dict[str, Any]) -> Snapshot:
        return Snapshot(**{**body, "backend": self.name})

    async def snapshot(self, sandbox_id: str, request: SnapshotRequest) -> Snapshot:
        if SNAPSHOTS not in self.capabilities:
            raise self.refuse(SNAPSHOTS)
        site = await self.locate(sandbox_id)
        body = await self.forward(site, "POST", f"/sandboxes/{_segment(sandbox_id)}/snapshot",
                                  json_body=request.model_dump(), timeout=300.0)
        snapshot = self._snapshot(body)
        self._snapshot_sites[snapshot.snapshot_id] = site.key
        return snapshot

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        site = await self._snapshot_site(snapshot_id)
        return self._snapshot(await self.forward(site, "GET", f"/snapshots/{_segment(snapshot_id)}"))

    async def list_snapshots(self) -> list[Snapshot]:
        if SNAPSHOTS not in self.capabilities:
            return []
        found: list[Snapshot] = []
        for site in await self.sites():
            if site.lost is None:
                found += [self._snapshot(item) for item in (await self.forward(site, "GET", "/snapshots"))["snapshots"]]
        return found

    async def delete_snapshot(self, snapshot_id: str) -> None:
        site = await self._snapshot_site(snapshot_id)
        await self.forward(site, "DELETE", f"/snapshots/{_segment(snapshot_id)}")
        self._snapshot_sites.pop(snapshot_id, None)

    async def reset(self, sandbox_id: str) -> Sandbox:
        if RESET not in self.capabilities:
            raise self.refuse(RESET)
        site = await self.locate(sandbox_id)
        if site.lost is not None:
            raise SandboxLost(f"sandbox {sandbox_id!r} is lost: {site.lost}")
        return self.answered(await self.forward(site, "POST", f"/sandboxes/{_segment(sandbox_id)}/reset",
                                                timeout=300.0))
