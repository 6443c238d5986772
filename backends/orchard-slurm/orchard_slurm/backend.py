"""``slurm``: sandboxes packed onto pilot jobs, each running one exec agent (the jobs
themselves are ``pool.py``'s business; this is the Backend interface on top).

The pool grows when every live pilot is full (up to ``max_pilots``) and shrinks when a
pilot has hosted nothing for ``pilot_idle_seconds``. A pilot whose job ends (scancel,
time limit, node failure, preemption) takes its sandboxes with it: they are reported
``lost`` with the Slurm state, and the next create submits a fresh pilot. Pilot records
live in the shared directory, so a restarted service adopts the pilots still running.

In per-job mode every sandbox gets a Slurm job of its own (a "pilot" of one, cancelled
when its sandbox is deleted) whose container runs the agent from the agent bundle
(see ``perjob.py``); placement, states, lost reasons and orphans work the same way.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from orchard.backends.api import AgentEndpoint, Backend
from orchard.errors import AgentUnreachable, BackendUnavailable, InvalidRequest, OrchardError, SandboxLost
from orchard.models import Sandbox, SandboxSpec
from orchard_slurm.config import SlurmConfig
from orchard_slurm.pool import Pilot, PilotPool

log = logging.getLogger("orchard.slurm")


class SlurmBackend(Backend):
    name = "slurm"
    config_model = SlurmConfig

    def __init__(self, config: SlurmConfig) -> None:
        super().__init__(config)
        self.config: SlurmConfig = config
        self.pool = PilotPool(config)

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        missing = [tool for tool in ("sbatch", "squeue", "scancel") if shutil.which(tool) is None]
        return f"Slurm commands not found: {', '.join(missing)}" if missing else None

    def _check_per_job_image(self, image: str) -> None:
        if self.config.runtime == "apptainer":
            if image == "host":
                raise InvalidRequest("per-job mode runs each sandbox in its own container: ask for an image")
        elif not image.startswith("docker://") and not Path(image).is_dir():
            raise InvalidRequest(f"per-job mode with {self.config.runtime} containers runs docker:// or directory "
                                 f"images; {image!r} is neither")

    def _lost(self, sandbox_id: str, pilot: Pilot) -> Sandbox:
        return Sandbox(sandbox_id=sandbox_id, image="unknown", status="lost", status_message=pilot.lost_reason(),
                       backend=self.name)

    # -- the Backend interface -------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> Sandbox:
        spec = spec.model_copy(update={"sandbox_id": spec.sandbox_id or f"sbx-{secrets.token_hex(6)}"})
        sandbox_id = spec.sandbox_id
        known = self.pool.pilots.get(self.pool.owner.get(sandbox_id, ""))
        if known is not None:  # the same id again: its agent answers (idempotent, or a conflict)
            return await self._create_on(known, spec)
        if self.config.mode == "per-job":
            self._check_per_job_image(spec.image)
        pilot = await self.pool.place(spec)
        pilot.sandboxes.add(sandbox_id)  # reserved before the agent answers, so packing counts it
        self.pool.owner[sandbox_id] = pilot.pilot_id
        try:
            return await self._create_on(pilot, spec)
        except BaseException:
            pilot.sandboxes.discard(sandbox_id)
            self.pool.owner.pop(sandbox_id, None)
            pilot.idle_since = time.time()
            if self.config.mode == "per-job":  # its job exists for this sandbox alone: end it, leave nothing
                await self.pool.cancel_pilot(pilot)
            raise

    async def _create_on(self, pilot: Pilot, spec: SandboxSpec) -> Sandbox:
        await asyncio.wait_for(pilot.ready.wait(), self.config.pilot_start_timeout + 5)
        if pilot.api is None or not pilot.alive:
            raise BackendUnavailable(pilot.failure or f"no agent on {pilot.lost_reason()}")
        # per-job: the container is the image, and the agent inside it runs commands in place
        asked = spec.model_copy(update={"image": "host"}) if self.config.mode == "per-job" else spec
        body = await pilot.api.request("POST", "/sandboxes", json_body=asked.model_dump(),
                                       timeout=(spec.timeout or 60) + 30)
        return Sandbox(**{**body, "image": spec.image, "backend": self.name})

    async def delete(self, sandbox_id: str) -> None:
        pilot = self.pool.pilot_of(sandbox_id)
        try:
            if pilot.alive and pilot.api is not None:
                await pilot.api.request("DELETE", f"/sandboxes/{sandbox_id}")
        finally:
            pilot.sandboxes.discard(sandbox_id)
            self.pool.owner.pop(sandbox_id, None)
            if not pilot.sandboxes:
                pilot.idle_since = time.time()
            await self.pool.shrink()

    async def maintain(self) -> None:
        """Cancel orphaned jobs, keep ``min_pilots`` warm, end idle pilots."""
        await self.pool.adopt()
        await self.pool.refresh(force=True)
        await self.pool.cancel_orphans()
        async with self.pool.lock:
            await self.pool.keep_warm()  # the reconciler's first round comes soon after a service starts
        await self.pool.shrink()

    async def list(self) -> list[Sandbox]:
        """What runs, read from Slurm and the agents (submits and cancels nothing)."""
        await self.pool.adopt()
        await self.pool.refresh(force=True)
        found: list[Sandbox] = []
        for pilot in list(self.pool.pilots.values()):
            if pilot.alive and pilot.api is not None:
                found += await self._listed_by(pilot)
            elif not pilot.alive:
                found += [self._lost(sandbox_id, pilot) for sandbox_id in sorted(pilot.sandboxes)]
        return found

    async def _listed_by(self, pilot: Pilot) -> list[Sandbox]:
        """What one agent says it hosts, believed only for sandboxes placed on it: a per-job
        agent shares its container with hostile code and could claim (or report lost) a
        neighbour's sandbox. An agent whose answer cannot be read keeps its sandboxes as they
        were, rather than failing the whole listing."""
        try:
            body = await pilot.api.request("GET", "/sandboxes")  # type: ignore[union-attr]
            items = [Sandbox(**{**item, "backend": self.name}) for item in body["sandboxes"]]
        except (OrchardError, ValueError, TypeError, KeyError, RecursionError) as exc:
            log.warning("pilot %s answered its listing unreadably: %s", pilot.pilot_id, exc)
            return [Sandbox(sandbox_id=sandbox_id, image="", status="ready", ready=True, backend=self.name)
                    for sandbox_id in sorted(pilot.sandboxes)]
        strangers = [item.sandbox_id for item in items if self.pool.owner.get(item.sandbox_id) != pilot.pilot_id]
        if strangers:
            log.warning("pilot %s listed sandboxes placed elsewhere (ignored): %s", pilot.pilot_id, strangers[:5])
        return [item for item in items if self.pool.owner.get(item.sandbox_id) == pilot.pilot_id]

    async def status(self, sandbox_id: str) -> Sandbox:
        await self.pool.adopt()
        pilot = self.pool.pilot_of(sandbox_id)
        await self.pool.refresh()
        if not pilot.alive:
            return self._lost(sandbox_id, pilot)
        await asyncio.wait_for(pilot.ready.wait(), self.config.pilot_start_timeout + 5)
        if pilot.api is None:
            return self._lost(sandbox_id, pilot)
        try:
            return Sandbox(**{**await pilot.api.request("GET", f"/sandboxes/{sandbox_id}"), "backend": self.name})
        except AgentUnreachable:
            await self.pool.refresh(force=True)  # the agent went away: ask Slurm why, now
            if not pilot.alive:
                return self._lost(sandbox_id, pilot)
            raise

    async def endpoint(self, sandbox_id: str) -> AgentEndpoint:
        await self.pool.adopt()
        pilot = self.pool.pilot_of(sandbox_id)
        await self.pool.refresh()
        if not pilot.alive:
            raise SandboxLost(f"sandbox {sandbox_id!r} is lost: {pilot.lost_reason()}")
        await asyncio.wait_for(pilot.ready.wait(), self.config.pilot_start_timeout + 5)
        if pilot.url is None:
            raise SandboxLost(f"sandbox {sandbox_id!r} is lost: {pilot.lost_reason()}")
        return AgentEndpoint(url=pilot.url, token=pilot.token)

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

    async def close(self) -> None:
        await self.pool.close()
