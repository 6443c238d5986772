"""``slurm``: sandboxes packed onto pilot jobs, each running one exec agent.

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
import hashlib
import json
import logging
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from orchard.backends.api import AgentEndpoint, Backend
from orchard.client.http import ApiClient
from orchard.errors import (AgentUnreachable, BackendUnavailable, InvalidRequest, OrchardError, SandboxLost,
                            SandboxNotFound)
from orchard.models import Sandbox, SandboxSpec
from orchard_slurm import slurm
from orchard_slurm.config import SlurmConfig
from orchard_slurm.perjob import SandboxJob, run_sandbox_job
from orchard_slurm.pilot import read_stop_record, run_pilot

log = logging.getLogger(__name__)
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unavailable|Exit)\b.*: ")  # a traceback's last line


@dataclass
class Pilot:
    pilot_id: str
    job_id: str
    directory: Path
    submitted_at: float
    time_limit_seconds: float
    sandboxes: set[str] = field(default_factory=set)
    state: str = "PENDING"
    ready_at: Optional[float] = None
    url: Optional[str] = None
    token: Optional[str] = None
    api: Optional[ApiClient] = None
    idle_since: float = field(default_factory=time.time)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    failure: Optional[str] = None

    @property
    def alive(self) -> bool:
        return self.state in slurm.LIVE_STATES and self.failure is None

    def remaining_seconds(self) -> float:
        start = self.ready_at or time.time()
        return start + self.time_limit_seconds - time.time()

    def lost_reason(self) -> str:
        if self.failure:
            return self.failure
        stopped = read_stop_record(self.directory)
        if stopped:
            return (f"its pilot, Slurm job {self.job_id}, stopped on {stopped['signal']} ({stopped['reason']}) "
                    f"and ended: {self.state}")
        return f"its pilot, Slurm job {self.job_id}, ended: {self.state}"


class SlurmBackend(Backend):
    name = "slurm"
    config_model = SlurmConfig

    def __init__(self, config: SlurmConfig) -> None:
        super().__init__(config)
        self.config: SlurmConfig = config
        self.pilots: dict[str, Pilot] = {}
        self.owner: dict[str, str] = {}  # sandbox id -> pilot id
        self._pool = asyncio.Lock()
        self._states_at = 0.0
        self._adopted = False
        self.orphans_cancelled = 0
        self.pilots_submitted = 0

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        missing = [tool for tool in ("sbatch", "squeue", "scancel") if shutil.which(tool) is None]
        return f"Slurm commands not found: {', '.join(missing)}" if missing else None

    # -- pilots --------------------------------------------------------------------
    @property
    def pilots_dir(self) -> Path:
        return self.config.shared_dir / "pilots"

    @property
    def job_comment(self) -> str:
        """Marks this service's pilots in Slurm (one service per shared directory)."""
        digest = hashlib.sha256(str(self.config.shared_dir.resolve()).encode()).hexdigest()[:16]
        return f"orchard-pilots-{digest}"

    def _executor(self) -> Any:
        import submitit

        config = self.config
        executor = submitit.SlurmExecutor(folder=str(config.shared_dir / "submitit" / "%j"))
        parameters: dict[str, Any] = {
            "job_name": config.job_name, "time": config.time_limit_minutes, "cpus_per_task": config.cpus_per_pilot,
            "mem": f"{max(1, int(config.mem_per_pilot_gb * 1024))}M", "ntasks_per_node": 1, "nodes": 1,
            "signal_delay_s": config.stop_margin_seconds, "comment": self.job_comment,
            "additional_parameters": {"no_requeue": True},  # a requeued pilot would come back empty
        }
        for key in ("partition", "account", "qos"):
            if getattr(config, key):
                parameters[key] = getattr(config, key)
        if config.gpus_per_pilot:
            parameters["gpus_per_node"] = config.gpus_per_pilot
        executor.update_parameters(**parameters)
        return executor

    def _new_directory(self) -> tuple[str, Path]:
        pilot_id = f"pilot-{secrets.token_hex(4)}"
        directory = self.pilots_dir / pilot_id
        directory.mkdir(parents=True)
        directory.chmod(0o711)  # sandbox roots below must be reachable by the sandbox uid; the token file is 0600
        return pilot_id, directory

    def _pilot_call(self, directory: Path) -> tuple:
        return (run_pilot, str(directory), self.config.runtime, self.config.agent_host, self.config.sandboxes_per_pilot)

    async def _submit(self, spec: Optional[SandboxSpec] = None) -> Pilot:
        """Submit a pilot, or (per-job mode, given the sandbox's spec) the job of one sandbox."""
        if spec is None:
            return (await self._submit_pilots(1))[0]
        pilot_id, directory = self._new_directory()
        cache = self.config.image_cache_dir or self.config.shared_dir / "image-cache"
        call = (run_sandbox_job, SandboxJob(str(directory), str(spec.sandbox_id), spec.image, self.config.runtime,
                                            spec.block_network, str(await self._bundle()), self.config.agent_host,
                                            str(cache), tuple(self.config.insecure_registries)))
        submitted_at = time.time()
        job = await asyncio.to_thread(self._executor().submit, *call)
        return self._track(pilot_id, directory, str(job.job_id), submitted_at)

    async def _submit_pilots(self, count: int) -> list[Pilot]:
        """Submit ``count`` pilots: one job, or one job array of ``count`` tasks."""
        made = [self._new_directory() for _ in range(count)]
        executor = self._executor()

        def submit() -> list[Any]:
            if count == 1:
                return [executor.submit(*self._pilot_call(made[0][1]))]
            with executor.batch():
                jobs = [executor.submit(*self._pilot_call(directory)) for _, directory in made]
            return jobs

        submitted_at = time.time()
        jobs = await asyncio.to_thread(submit)
        return [self._track(pilot_id, directory, str(job.job_id), submitted_at)
                for (pilot_id, directory), job in zip(made, jobs)]

    def _track(self, pilot_id: str, directory: Path, job_id: str, submitted_at: float) -> Pilot:
        pilot = Pilot(pilot_id, job_id, directory, submitted_at, self.config.time_limit_minutes * 60.0)
        self.pilots_submitted += 1
        (directory / "pilot.json").write_text(json.dumps({"job_id": pilot.job_id, "submitted_at": pilot.submitted_at,
                                                          "time_limit_seconds": pilot.time_limit_seconds}))
        self.pilots[pilot_id] = pilot
        asyncio.get_running_loop().create_task(self._await_agent(pilot))
        return pilot

    async def _keep_warm(self) -> None:
        """Top the pool up to ``min_pilots`` live pilots, in one job array (pilot mode)."""
        if self.config.mode != "pilot" or not self.config.min_pilots:
            return
        live = sum(1 for p in self.pilots.values() if p.alive)
        if live < self.config.min_pilots:
            await self._submit_pilots(self.config.min_pilots - live)

    async def _await_agent(self, pilot: Pilot) -> None:
        """Wait for the pilot's agent to report its address; give up when its job ends."""
        deadline = time.monotonic() + self.config.pilot_start_timeout
        info_path, token_path = pilot.directory / "agent" / "agent.json", pilot.directory / "agent" / "token"
        try:
            while not (info_path.exists() and token_path.exists()):
                await self._refresh(force=time.time() - pilot.submitted_at > 1)
                if not pilot.alive:
                    why = self._startup_log(pilot)
                    if why:
                        pilot.failure = f"Slurm job {pilot.job_id} ended ({pilot.state}) before its agent started: {why}"
                    return
                if time.monotonic() > deadline:
                    pilot.failure = f"pilot job {pilot.job_id} had no agent after {self.config.pilot_start_timeout:.0f} s"
                    await slurm.cancel(pilot.job_id)
                    return
                await asyncio.sleep(0.1)
            self._connect(pilot, json.loads(info_path.read_text()), token_path.read_text().strip())
        except (OSError, ValueError, OrchardError) as exc:
            pilot.failure = f"pilot job {pilot.job_id}: {exc}"
        finally:
            pilot.ready.set()

    def _startup_log(self, pilot: Pilot) -> Optional[str]:
        """The end of what a job that never got its agent up wrote (a per-job container's log,
        else submitit's stderr), so a site's mistake reads as its own error message."""
        logs = [pilot.directory / "container.log",
                *sorted((self.config.shared_dir / "submitit" / pilot.job_id).glob("*_log.err"))]
        for log_file in logs:
            try:
                text = log_file.read_text(errors="replace").strip()
            except OSError:
                continue
            if text:
                errors = [line for line in text.splitlines() if EXCEPTION_LINE.match(line)]
                return errors[-1] if errors else " | ".join(text.splitlines()[-5:])[-1200:]
        return None

    def _connect(self, pilot: Pilot, info: dict, token: str) -> None:
        pilot.url, pilot.token = info["address"], token
        pilot.api = ApiClient(pilot.url, token, retries=2)
        pilot.ready_at = pilot.ready_at or time.time()
        pilot.state = "RUNNING"

    async def _refresh(self, force: bool = False) -> None:
        """Slurm states of the pilots, at most every ``slurm_poll_seconds``."""
        if not force and time.monotonic() - self._states_at < self.config.slurm_poll_seconds:
            return
        self._states_at = time.monotonic()
        states = await slurm.job_states(p.job_id for p in self.pilots.values() if p.state in slurm.LIVE_STATES)
        for pilot in self.pilots.values():
            if pilot.job_id in states:
                pilot.state = states[pilot.job_id]
                if not pilot.alive:
                    pilot.ready.set()

    async def _adopt(self) -> None:
        """Pilots a previous service left running (their records are in the shared directory)."""
        if self._adopted:
            return
        self._adopted = True
        for record in sorted(self.pilots_dir.glob("*/pilot.json")) if self.pilots_dir.exists() else []:
            directory = record.parent
            if directory.name in self.pilots:
                continue
            data = json.loads(record.read_text())
            pilot = Pilot(directory.name, data["job_id"], directory, data["submitted_at"], data["time_limit_seconds"])
            states = await slurm.job_states([pilot.job_id])
            pilot.state = states.get(pilot.job_id, "GONE")
            info, token = directory / "agent" / "agent.json", directory / "agent" / "token"
            if pilot.state != "RUNNING" or not info.exists():
                continue
            self._connect(pilot, json.loads(info.read_text()), token.read_text().strip())
            pilot.ready.set()
            self.pilots[pilot.pilot_id] = pilot
            for item in (await pilot.api.request("GET", "/sandboxes"))["sandboxes"]:
                pilot.sandboxes.add(item["sandbox_id"])
                self.owner[item["sandbox_id"]] = pilot.pilot_id

    async def _bundle(self) -> Path:
        """Per-job mode: the agent bundle the containers run, built once into the shared directory."""
        bundle = self.config.bundle_dir or self.config.shared_dir / "agent-bundle"
        if not (bundle / "orchard-bundle.json").exists():
            from orchard.bundle.build import build_bundle

            log.info("building the agent bundle into %s", bundle)
            await asyncio.to_thread(build_bundle, bundle, True)
        return bundle

    def _check_per_job_image(self, image: str) -> None:
        if self.config.runtime == "apptainer":
            if image == "host":
                raise InvalidRequest("per-job mode runs each sandbox in its own container: ask for an image")
        elif not image.startswith("docker://") and not Path(image).is_dir():
            raise InvalidRequest(f"per-job mode with {self.config.runtime} containers runs docker:// or directory "
                                 f"images; {image!r} is neither")

    async def _place(self, spec: SandboxSpec) -> Pilot:
        """A live pilot with room and walltime left, else a new one (bounded by max_pilots);
        in per-job mode always a new job for this sandbox."""
        async with self._pool:
            await self._adopt()
            await self._refresh()
            if self.config.mode == "per-job":
                live = sum(1 for p in self.pilots.values() if p.alive)
                if live >= self.config.max_pilots:
                    raise BackendUnavailable(f"{live} sandbox jobs are running and max_pilots is "
                                             f"{self.config.max_pilots} (per-job mode: one job per sandbox)")
                return await self._submit(spec)
            await self._keep_warm()
            margin = self.config.min_remaining_minutes * 60 + self.config.stop_margin_seconds
            for pilot in sorted(self.pilots.values(), key=lambda p: p.submitted_at):
                if (pilot.alive and len(pilot.sandboxes) < self.config.sandboxes_per_pilot
                        and pilot.remaining_seconds() > margin):
                    return pilot
            live = sum(1 for p in self.pilots.values() if p.alive)
            if live >= self.config.max_pilots:
                raise BackendUnavailable(f"all {live} pilots are full ({self.config.sandboxes_per_pilot} sandboxes "
                                         f"each) and max_pilots is {self.config.max_pilots}")
            return await self._submit()

    async def _shrink(self) -> None:
        now = time.time()
        for pilot in list(self.pilots.values()):
            if not pilot.alive:
                if not pilot.sandboxes:
                    self._forget(pilot)
                continue
            if pilot.sandboxes or pilot.url is None:
                continue
            idle_limit = 0 if self.config.mode == "per-job" else self.config.pilot_idle_seconds
            live = sum(1 for p in self.pilots.values() if p.alive)
            if now - pilot.idle_since >= idle_limit and live > self.config.min_pilots:
                await slurm.cancel(pilot.job_id)
                pilot.state = "CANCELLED"
                self._forget(pilot)

    def _forget(self, pilot: Pilot) -> None:
        self.pilots.pop(pilot.pilot_id, None)
        if pilot.api is not None:
            asyncio.get_running_loop().create_task(pilot.api.close())
        shutil.rmtree(pilot.directory, ignore_errors=True)

    def _pilot_of(self, sandbox_id: str) -> Pilot:
        pilot = self.pilots.get(self.owner.get(sandbox_id, ""))
        if pilot is None:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return pilot

    def _lost(self, sandbox_id: str, pilot: Pilot) -> Sandbox:
        return Sandbox(sandbox_id=sandbox_id, image="unknown", status="lost", status_message=pilot.lost_reason(),
                       backend=self.name)

    # -- the Backend interface -------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> Sandbox:
        spec = spec.model_copy(update={"sandbox_id": spec.sandbox_id or f"sbx-{secrets.token_hex(6)}"})
        sandbox_id = spec.sandbox_id
        known = self.pilots.get(self.owner.get(sandbox_id, ""))
        if known is not None:  # the same id again: its agent answers (idempotent, or a conflict)
            return await self._create_on(known, spec)
        if self.config.mode == "per-job":
            self._check_per_job_image(spec.image)
        pilot = await self._place(spec)
        pilot.sandboxes.add(sandbox_id)  # reserved before the agent answers, so packing counts it
        self.owner[sandbox_id] = pilot.pilot_id
        try:
            return await self._create_on(pilot, spec)
        except BaseException:
            pilot.sandboxes.discard(sandbox_id)
            self.owner.pop(sandbox_id, None)
            pilot.idle_since = time.time()
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
        pilot = self._pilot_of(sandbox_id)
        try:
            if pilot.alive and pilot.api is not None:
                await pilot.api.request("DELETE", f"/sandboxes/{sandbox_id}")
        finally:
            pilot.sandboxes.discard(sandbox_id)
            self.owner.pop(sandbox_id, None)
            if not pilot.sandboxes:
                pilot.idle_since = time.time()
            await self._shrink()

    async def list(self) -> list[Sandbox]:
        await self._adopt()
        await self._refresh(force=True)
        await self._cancel_orphans()
        async with self._pool:
            await self._keep_warm()  # the reconciler lists soon after a service starts
        found: list[Sandbox] = []
        for pilot in list(self.pilots.values()):
            if pilot.alive and pilot.api is not None:
                body = await pilot.api.request("GET", "/sandboxes")
                found += [Sandbox(**{**item, "backend": self.name}) for item in body["sandboxes"]]
            elif not pilot.alive:
                found += [self._lost(sandbox_id, pilot) for sandbox_id in sorted(pilot.sandboxes)]
        await self._shrink()
        return found

    async def _cancel_orphans(self) -> None:
        """Cancel this service's pilot jobs it has no record of (records lost, or never adopted)."""
        async with self._pool:  # no submission in flight: every job we submitted is in self.pilots
            known = {pilot.job_id for pilot in self.pilots.values()}
            for job_id in sorted(set(await slurm.jobs_named(self.config.job_name, self.job_comment)) - known):
                log.warning("cancelling orphaned pilot job %s", job_id)
                await slurm.cancel(job_id)
                self.orphans_cancelled += 1

    async def status(self, sandbox_id: str) -> Sandbox:
        await self._adopt()
        pilot = self._pilot_of(sandbox_id)
        await self._refresh()
        if not pilot.alive:
            return self._lost(sandbox_id, pilot)
        await asyncio.wait_for(pilot.ready.wait(), self.config.pilot_start_timeout + 5)
        if pilot.api is None:
            return self._lost(sandbox_id, pilot)
        try:
            return Sandbox(**{**await pilot.api.request("GET", f"/sandboxes/{sandbox_id}"), "backend": self.name})
        except AgentUnreachable:
            await self._refresh(force=True)  # the agent went away: ask Slurm why, now
            if not pilot.alive:
                return self._lost(sandbox_id, pilot)
            raise

    async def endpoint(self, sandbox_id: str) -> AgentEndpoint:
        await self._adopt()
        pilot = self._pilot_of(sandbox_id)
        await self._refresh()
        if not pilot.alive:
            raise SandboxLost(f"sandbox {sandbox_id!r} is lost: {pilot.lost_reason()}")
        await asyncio.wait_for(pilot.ready.wait(), self.config.pilot_start_timeout + 5)
        if pilot.url is None:
            raise SandboxLost(f"sandbox {sandbox_id!r} is lost: {pilot.lost_reason()}")
        return AgentEndpoint(url=pilot.url, token=pilot.token)

    async def resources(self) -> dict[str, Any]:
        live = [p for p in self.pilots.values() if p.alive]
        return {"pilots": len(live), "max_pilots": self.config.max_pilots, "orphans_cancelled": self.orphans_cancelled,
                "sandboxes": sum(len(p.sandboxes) for p in live),
                "capacity": self.config.max_pilots * self.config.sandboxes_per_pilot,
                "pilot_jobs": {p.pilot_id: {"job_id": p.job_id, "state": p.state, "sandboxes": len(p.sandboxes),
                                            "remaining_seconds": round(p.remaining_seconds())} for p in live}}

    async def pilot_jobs(self) -> list[dict[str, Any]]:
        """Every live job of this service (adopted, or found by job name and comment)."""
        await self._adopt()
        await self._refresh(force=True)
        known = {pilot.job_id: pilot for pilot in self.pilots.values()}
        rows = []
        for job_id, state in sorted((await slurm.jobs_named(self.config.job_name, self.job_comment)).items()):
            pilot = known.get(job_id)
            rows.append({"job_id": job_id, "state": state, "pilot": pilot.pilot_id if pilot else None,
                         "address": pilot.url if pilot else None,
                         "sandboxes": len(pilot.sandboxes) if pilot else None,
                         "remaining_seconds": round(pilot.remaining_seconds()) if pilot and pilot.ready_at else None})
        return rows

    async def cancel_all(self) -> int:
        """Cancel every job of this service (and so every sandbox on it): the known pilots and
        the ones found by job name and comment. Returns how many."""
        await self._adopt()
        jobs = set(await slurm.jobs_named(self.config.job_name, self.job_comment))
        for pilot in list(self.pilots.values()):
            jobs.add(pilot.job_id)
            pilot.state = "CANCELLED"
            pilot.sandboxes.clear()
            self._forget(pilot)
        for job_id in sorted(jobs):
            await slurm.cancel(job_id)
        return len(jobs)

    async def close(self) -> None:
        """Cancel the pilots that host nothing (the rest stay, for a restarted service to adopt)."""
        for pilot in list(self.pilots.values()):
            if not pilot.sandboxes and pilot.alive:
                await slurm.cancel(pilot.job_id)
                self.pilots.pop(pilot.pilot_id, None)
                shutil.rmtree(pilot.directory, ignore_errors=True)
            if pilot.api is not None:
                await pilot.api.close()
