"""``slurm``: sandboxes on exec agents that Slurm jobs run (the jobs themselves are
``pool.py``'s business; this is the placement on top).

Two placements, picked by ``mode``:

- **pilots** (``SlurmBackend``): sandboxes are packed onto pilot jobs, each running one
  agent. The pool grows when every live pilot is full (up to ``max_pilots``) and shrinks
  when a pilot has hosted nothing for ``pilot_idle_seconds``.
- **per-job** (``PerJobSlurmBackend``): every sandbox gets a Slurm job of its own whose
  container runs the agent from the agent bundle (see ``perjob.py``), cancelled when its
  sandbox is deleted or fails to start.

Either way, a job that ends (scancel, time limit, node failure, preemption) takes its
sandboxes with it: they are reported ``lost`` with the Slurm state. Job records live in
the shared directory, so a restarted service adopts the jobs still running.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from orchard.backends.agent_backed import AgentBackedBackend, AgentSite
from orchard.backends.api import RESET, SNAPSHOTS, AgentEndpoint
from orchard.backends.checks import Check
from orchard.errors import BackendUnavailable, InvalidRequest, QuotaExceeded, SandboxLost
from orchard.models import SandboxSpec, Snapshot, SnapshotRequest
from orchard.quantities import parse_memory
from orchard_slurm.checks import slurm_checks
from orchard_slurm.config import SlurmConfig
from orchard_slurm.pool import Pilot, PilotPool


class SlurmBackend(AgentBackedBackend):
    name = "slurm"
    config_model = SlurmConfig
    capabilities = frozenset({SNAPSHOTS, RESET})  # pilots' agents run bwrap sandboxes (other runtimes may refuse)

    def __new__(cls, config: SlurmConfig) -> "SlurmBackend":
        if cls is SlurmBackend and config.mode == "per-job":  # one backend name, two placements
            cls = PerJobSlurmBackend
        return super().__new__(cls)

    def __init__(self, config: SlurmConfig) -> None:
        super().__init__(config)
        self.config: SlurmConfig = config
        self.pool = PilotPool(config)

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        missing = [tool for tool in ("sbatch", "squeue", "scancel") if shutil.which(tool) is None]
        return f"Slurm commands not found: {', '.join(missing)}" if missing else None

    @classmethod
    def doctor(cls, settings: dict[str, Any]) -> list[Check]:
        return slurm_checks(settings)

    # -- placement: a pilot job with room ----------------------------------------------
    def site(self, pilot: Pilot) -> AgentSite:
        lost = None if pilot.alive and (pilot.api is not None or not pilot.ready.is_set()) else pilot.lost_reason()
        endpoint = AgentEndpoint(url=pilot.url, token=pilot.token) if pilot.url else None
        return AgentSite(pilot.pilot_id, pilot.api, endpoint, placed=pilot.sandboxes, lost=lost)

    async def _ready(self, pilot: Pilot) -> AgentSite:
        await asyncio.wait_for(pilot.ready.wait(), self.config.pilot_start_timeout + 5)
        return self.site(pilot)

    def _reserve(self, pilot: Pilot, sandbox_id: str) -> None:
        pilot.sandboxes.add(sandbox_id)  # before its agent answers, so packing counts it
        self.pool.owner[sandbox_id] = pilot.pilot_id

    async def _started(self, pilot: Pilot, sandbox_id: str) -> AgentSite:
        """Wait for the job's agent; a job that never got one is released and the create fails."""
        try:
            site = await self._ready(pilot)
            if site.lost is not None or site.api is None:
                raise BackendUnavailable(pilot.failure or f"no agent on {pilot.lost_reason()}")
            return site
        except BaseException:
            await self.release(self.site(pilot), sandbox_id, failed=True)
            raise

    def _check_memory(self, spec: SandboxSpec) -> None:
        share = self.config.sandbox_memory_share()
        if spec.memory and parse_memory(spec.memory) > share:
            raise InvalidRequest(f"memory: at most {share >> 20} MiB per sandbox on these pilots (mem_per_pilot_gb "
                                 f"{self.config.mem_per_pilot_gb:g}, less 256 MiB for the agent, shared by "
                                 f"sandboxes_per_pilot {self.config.sandboxes_per_pilot})")

    async def place(self, spec: SandboxSpec) -> AgentSite:
        self._check_memory(spec)
        pilot = await self.pool.place_on_pilot()
        self._reserve(pilot, str(spec.sandbox_id))
        return await self._started(pilot, str(spec.sandbox_id))

    async def place_fork(self, spec: SandboxSpec, site: AgentSite) -> AgentSite:
        """A fork runs on the pilot that keeps its snapshot (the layers are that node's)."""
        self._check_memory(spec)
        async with self.pool.lock:
            pilot = self.pool.pilots.get(site.key)
            if pilot is None or not pilot.alive:
                raise SandboxLost(f"the pilot keeping snapshot {spec.snapshot!r} is gone")
            if len(pilot.sandboxes) >= self.config.sandboxes_per_pilot:
                raise QuotaExceeded(f"pilot {pilot.pilot_id}, which keeps snapshot {spec.snapshot!r}, is full "
                                    f"({self.config.sandboxes_per_pilot} sandboxes, sandboxes_per_pilot): forks run "
                                    "where their snapshot is")
            self._reserve(pilot, str(spec.sandbox_id))
        return await self._started(pilot, str(spec.sandbox_id))

    async def placed(self, sandbox_id: str) -> Optional[AgentSite]:
        pilot = self.pool.pilots.get(self.pool.owner.get(sandbox_id, ""))
        return None if pilot is None else await self._ready(pilot)

    async def locate(self, sandbox_id: str) -> AgentSite:
        await self.pool.adopt()
        pilot = self.pool.pilot_of(sandbox_id)
        await self.pool.refresh()
        return await self._ready(pilot) if pilot.alive else self.site(pilot)

    async def sites(self) -> list[AgentSite]:
        """Read from Slurm and the job records (submits and cancels nothing); pilots still
        starting have nothing to list yet."""
        await self.pool.adopt()
        await self.pool.refresh(force=True)
        return [site for site in map(self.site, list(self.pool.pilots.values()))
                if site.lost is not None or site.api is not None]

    async def recheck(self, site: AgentSite) -> AgentSite:
        await self.pool.refresh(force=True)
        pilot = self.pool.pilots.get(site.key)
        return self.site(pilot) if pilot is not None else site

    async def release(self, site: AgentSite, sandbox_id: str, *, failed: bool = False) -> None:
        pilot = self.pool.pilots.get(site.key)
        if pilot is None:
            return
        pilot.sandboxes.discard(sandbox_id)
        if self.pool.owner.get(sandbox_id) == pilot.pilot_id:  # never another pilot's claim to this id
            del self.pool.owner[sandbox_id]
        if not pilot.sandboxes:
            pilot.idle_since = time.time()
        if not failed:
            await self.pool.shrink()

    # -- snapshots: a pilot keeping one is not idle -------------------------------------
    async def snapshot(self, sandbox_id: str, request: SnapshotRequest) -> Snapshot:
        snapshot = await super().snapshot(sandbox_id, request)
        pilot = self.pool.pilots.get(self._snapshot_sites.get(snapshot.snapshot_id, ""))
        if pilot is not None:
            pilot.snapshots.add(snapshot.snapshot_id)
        return snapshot

    async def delete_snapshot(self, snapshot_id: str) -> None:
        site = await self._snapshot_site(snapshot_id)
        await super().delete_snapshot(snapshot_id)
        pilot = self.pool.pilots.get(site.key)
        if pilot is not None:
            pilot.snapshots.discard(snapshot_id)
            if not pilot.sandboxes and not pilot.snapshots:
                pilot.idle_since = time.time()
                await self.pool.shrink()

    # -- the rest of the Backend interface ---------------------------------------------
    async def maintain(self) -> None:
        """Cancel orphaned jobs, keep ``min_pilots`` warm, end idle pilots."""
        await self.pool.adopt()
        await self.pool.refresh(force=True)
        await self.pool.cancel_orphans()
        async with self.pool.lock:
            await self.pool.keep_warm()  # the reconciler's first round comes soon after a service starts
        await self.pool.shrink()

    async def resources(self) -> dict[str, Any]:
        live = self.pool.live()
        return {"pilots": len(live), "max_pilots": self.config.max_pilots, "orphans_cancelled": self.pool.orphans_cancelled,
                "sandboxes": sum(len(p.sandboxes) for p in live),
                "capacity": self.config.max_pilots * self.config.sandboxes_per_pilot,
                "pilot_jobs": {p.pilot_id: {"job_id": p.job_id, "state": p.state, "sandboxes": len(p.sandboxes),
                                            "remaining_seconds": round(p.remaining_seconds())} for p in live}}

    async def pilot_jobs(self) -> list[dict[str, Any]]:
        """Every live job of this service (adopted, or found by job name and comment)."""
        return await self.pool.jobs()

    async def cancel_all(self) -> int:
        """Cancel every job of this service, and so every sandbox on them; returns how many."""
        return await self.pool.cancel_all()

    async def shutdown(self) -> None:
        await self.pool.release_idle()

    async def close(self) -> None:
        await self.pool.close()


class PerJobSlurmBackend(SlurmBackend):
    capabilities = frozenset()  # the job's container is the sandbox: nothing to freeze or restart
    """Per-job placement: a Slurm job of its own for every sandbox, ended with it."""

    def _check_image(self, image: str) -> None:
        if self.config.runtime == "apptainer":
            if image == "host":
                raise InvalidRequest("per-job mode runs each sandbox in its own container: ask for an image")
        elif not image.startswith("docker://") and not Path(image).is_dir():
            raise InvalidRequest(f"per-job mode with {self.config.runtime} containers runs docker:// or directory "
                                 f"images; {image!r} is neither")

    async def place(self, spec: SandboxSpec) -> AgentSite:
        self._check_image(spec.image)
        pilot = await self.pool.submit_sandbox_job(spec)
        self._reserve(pilot, str(spec.sandbox_id))
        return await self._started(pilot, str(spec.sandbox_id))

    def agent_spec(self, spec: SandboxSpec) -> SandboxSpec:
        return spec.model_copy(update={"image": "host"})  # the container is the image; its agent runs in place

    async def release(self, site: AgentSite, sandbox_id: str, *, failed: bool = False) -> None:
        """Its job exists for this sandbox alone: end it, leave nothing."""
        pilot = self.pool.pilots.get(site.key)
        await super().release(site, sandbox_id, failed=True)
        if pilot is not None and pilot.job_id:
            await self.pool.cancel_pilot(pilot)
