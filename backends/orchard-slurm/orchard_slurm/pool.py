"""The pool of Slurm jobs behind the backend: pilots (or, in per-job mode, one job per
sandbox) submitted with submitit, their agents found in the shared directory, their
states read from squeue/sacct, adopted after a restart, shrunk when idle, and cancelled
when orphaned. ``backend.py`` puts the Backend interface on top."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from orchard.client.http import ApiClient
from orchard.agent.runtimes.mounts import remove_tree
from orchard.errors import BackendUnavailable, ImageRejected, InvalidRequest, OrchardError, SandboxNotFound
from orchard.models import SandboxSpec
from orchard.plugins import verify_image
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
    snapshots: set[str] = field(default_factory=set)  # kept by its agent: the pilot is not idle while they live
    state: str = "PENDING"
    ready_at: Optional[float] = None
    url: Optional[str] = None
    token: Optional[str] = None
    api: Optional[ApiClient] = None
    idle_since: float = field(default_factory=time.time)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    failure: Optional[str] = None
    stopped: Optional[dict] = None  # its stop.json: told to stop (its job may still be ending)
    node_failure: Optional[str] = None  # ended NODE_FAIL: which node, and why Slurm holds it down

    @property
    def alive(self) -> bool:
        return self.state in slurm.LIVE_STATES and self.failure is None and self.stopped is None

    def remaining_seconds(self) -> float:
        start = self.ready_at or time.time()
        return start + self.time_limit_seconds - time.time()

    def lost_reason(self) -> str:
        if self.failure:
            return self.failure
        stopped = self.stopped or read_stop_record(self.directory)
        if stopped:
            ended = "" if self.state in slurm.LIVE_STATES else f" and ended: {self.state}"
            return f"its pilot, Slurm job {self.job_id}, stopped on {stopped['signal']} ({stopped['reason']}){ended}"
        if self.state == "SIGNALING":  # still running, but stopping: before its agent was up to say so itself
            return (f"its pilot, Slurm job {self.job_id}, is being signalled by Slurm and stops (state SIGNALING: "
                    "its time-limit warning, or scancel --signal)")
        cause = f" ({self.node_failure})" if self.node_failure else ""
        return f"its pilot, Slurm job {self.job_id}, ended: {self.state}{cause}"

    def check_stopped(self) -> None:
        """Read the pilot's stop record (it writes one on Slurm's warning, before its agent goes)."""
        if self.stopped is None and self.url is not None:
            self.stopped = read_stop_record(self.directory)


class PilotPool:
    """Slurm jobs hosting agents, and which sandbox lives on which."""

    def __init__(self, config: SlurmConfig) -> None:
        self.config = config
        self.pilots: dict[str, Pilot] = {}
        self.owner: dict[str, str] = {}  # sandbox id -> pilot id
        self.lock = asyncio.Lock()  # placement and orphan sweeps: no submission goes unseen
        self._states_at = 0.0
        self._adopted = False
        self.orphans_cancelled = 0
        self.pilots_submitted = 0

    def live(self) -> list[Pilot]:
        return [pilot for pilot in self.pilots.values() if pilot.alive]

    @property
    def pilots_dir(self) -> Path:
        return self.config.shared_dir / "pilots"

    @property
    def job_comment(self) -> str:
        """Marks this service's pilots in Slurm (one service per shared directory)."""
        digest = hashlib.sha256(str(self.config.shared_dir.resolve()).encode()).hexdigest()[:16]
        return f"orchard-pilots-{digest}"

    def executor(self) -> Any:
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
        return (run_pilot, str(directory), self.config.runtime, self.config.agent_host, self.config.sandboxes_per_pilot,
                self.config.image_policy(), self.config.host_id_settings(), self.config.sandbox_memory_share())

    async def submit_sandbox_job(self, spec: SandboxSpec) -> Pilot:
        """Per-job mode: the Slurm job of one sandbox (its image checked and its limits refused
        before anything is submitted, so a refusal leaves no job behind)."""
        reason = verify_image(spec.image, self.config.image_policy())
        if reason:
            raise ImageRejected(f"image {spec.image!r} refused by policy: {reason}")
        asked = [name for name in ("memory", "pids", "cpu", "disk") if getattr(spec, name)]
        if asked:
            raise InvalidRequest(f"{', '.join(asked)}: a per-job sandbox has its Slurm job's resources "
                                 "(cpus_per_pilot, mem_per_pilot_gb); per-sandbox limits are not applied in this mode")
        async with self.lock:
            await self.adopt()
            await self.refresh()
            live = len(self.live())
            if live >= self.config.max_pilots:
                raise BackendUnavailable(f"{live} sandbox jobs are running and max_pilots is "
                                         f"{self.config.max_pilots} (per-job mode: one job per sandbox)")
            pilot_id, directory = self._new_directory()
            cache = self.config.image_cache_dir or self.config.shared_dir / "image-cache"
            call = (run_sandbox_job, SandboxJob(str(directory), str(spec.sandbox_id), spec.image, self.config.runtime,
                                                spec.block_network, str(await self.bundle()), self.config.agent_host,
                                                str(cache), self.config.image_policy(), self.config.host_id_settings(),
                                                int(self.config.mem_per_pilot_gb * (1 << 30)) // 2))
            submitted_at = time.time()
            job = await asyncio.to_thread(self.executor().submit, *call)
            return self._track(pilot_id, directory, str(job.job_id), submitted_at, str(spec.sandbox_id))

    async def submit_pilots(self, count: int) -> list[Pilot]:
        """Submit ``count`` pilots: one job, or one job array of ``count`` tasks."""
        made = [self._new_directory() for _ in range(count)]
        executor = self.executor()

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

    def _track(self, pilot_id: str, directory: Path, job_id: str, submitted_at: float,
               sandbox_id: Optional[str] = None) -> Pilot:
        """Record a submitted job; a per-job job's record names its one sandbox, which is all
        a restarted service will believe its agent about."""
        pilot = Pilot(pilot_id, job_id, directory, submitted_at, self.config.time_limit_minutes * 60.0)
        self.pilots_submitted += 1
        (directory / "pilot.json").write_text(json.dumps({"job_id": pilot.job_id, "submitted_at": pilot.submitted_at,
                                                          "time_limit_seconds": pilot.time_limit_seconds,
                                                          "sandbox_id": sandbox_id}))
        self.pilots[pilot_id] = pilot
        asyncio.get_running_loop().create_task(self._await_agent(pilot))
        return pilot

    async def keep_warm(self) -> None:
        """Top the pool up to ``min_pilots`` live pilots, in one job array (pilot mode)."""
        if self.config.mode != "pilot" or not self.config.min_pilots:
            return
        live = len(self.live())
        if live < self.config.min_pilots:
            await self.submit_pilots(self.config.min_pilots - live)

    async def _await_agent(self, pilot: Pilot) -> None:
        """Wait for the pilot's agent to report its address; give up when its job ends."""
        deadline = time.monotonic() + self.config.pilot_start_timeout
        info_path, token_path = pilot.directory / "agent" / "agent.json", pilot.directory / "agent" / "token"
        try:
            while not (info_path.exists() and token_path.exists() and _complete_json(info_path)):
                await self.refresh(force=time.time() - pilot.submitted_at > 1)
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

    async def refresh(self, force: bool = False) -> None:
        """Slurm states of the pilots, at most every ``slurm_poll_seconds``."""
        if not force and time.monotonic() - self._states_at < self.config.slurm_poll_seconds:
            return
        self._states_at = time.monotonic()
        states = await slurm.job_states(p.job_id for p in self.pilots.values() if p.state in slurm.LIVE_STATES)
        for pilot in list(self.pilots.values()):
            if pilot.job_id in states:
                if states[pilot.job_id] == "NODE_FAIL" and pilot.node_failure is None:  # once, while the node is down
                    pilot.node_failure = await slurm.node_failure(pilot.job_id) or ""  # before it reads as lost
                pilot.state = states[pilot.job_id]
            pilot.check_stopped()
            if not pilot.alive:
                pilot.ready.set()

    async def adopt(self) -> None:
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
            expected = data.get("sandbox_id")  # per-job: the one sandbox its job was submitted for
            for item in (await pilot.api.request("GET", "/sandboxes"))["sandboxes"]:
                sandbox_id = item.get("sandbox_id")
                if not isinstance(sandbox_id, str) or (expected is not None and sandbox_id != expected) \
                        or sandbox_id in self.owner:
                    continue  # an agent is believed only about its own sandboxes
                pilot.sandboxes.add(sandbox_id)
                self.owner[sandbox_id] = pilot.pilot_id

    async def bundle(self) -> Path:
        """Per-job mode: the agent bundle the containers run, built once into the shared directory."""
        bundle = self.config.bundle_dir or self.config.shared_dir / "agent-bundle"
        if not (bundle / "orchard-bundle.json").exists():
            from orchard.bundle.build import build_bundle

            log.info("building the agent bundle into %s", bundle)
            await asyncio.to_thread(build_bundle, bundle, True)
        return bundle

    async def place_on_pilot(self) -> Pilot:
        """A live pilot with room and walltime left, else a new one (bounded by max_pilots)."""
        async with self.lock:
            await self.adopt()
            await self.refresh()
            await self.keep_warm()
            margin = self.config.min_remaining_minutes * 60 + self.config.stop_margin_seconds
            for pilot in sorted(self.pilots.values(), key=lambda p: p.submitted_at):
                if (pilot.alive and len(pilot.sandboxes) < self.config.sandboxes_per_pilot
                        and pilot.remaining_seconds() > margin):
                    return pilot
            live = len(self.live())
            if live >= self.config.max_pilots:
                raise BackendUnavailable(f"all {live} pilots are full ({self.config.sandboxes_per_pilot} sandboxes "
                                         f"each) and max_pilots is {self.config.max_pilots}")
            return (await self.submit_pilots(1))[0]

    async def shrink(self) -> None:
        now = time.time()
        for pilot in list(self.pilots.values()):
            if not pilot.alive:
                if not pilot.sandboxes:
                    await self.forget(pilot)
                continue
            if pilot.sandboxes or pilot.snapshots or pilot.url is None:
                continue
            idle_limit = 0 if self.config.mode == "per-job" else self.config.pilot_idle_seconds
            live = len(self.live())
            if now - pilot.idle_since >= idle_limit and live > self.config.min_pilots:
                await slurm.cancel(pilot.job_id)
                pilot.state = "CANCELLED"
                await self.forget(pilot)

    async def cancel_pilot(self, pilot: Pilot) -> None:
        """End one job now (a per-job sandbox that failed to start) and forget it."""
        try:
            await slurm.cancel(pilot.job_id)
        finally:
            pilot.state = "CANCELLED"
            await self.forget(pilot)

    async def forget(self, pilot: Pilot) -> None:
        self.pilots.pop(pilot.pilot_id, None)
        if pilot.api is not None:
            await pilot.api.close()
        remove_tree(pilot.directory)  # never through a dead pilot's live mounts

    def pilot_of(self, sandbox_id: str) -> Pilot:
        pilot = self.pilots.get(self.owner.get(sandbox_id, ""))
        if pilot is None:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return pilot

    async def cancel_orphans(self) -> None:
        """Cancel this service's pilot jobs it has no record of (records lost, or never adopted)."""
        async with self.lock:  # no submission in flight: every job we submitted is in self.pilots
            known = {pilot.job_id for pilot in self.pilots.values()}
            for job_id in sorted(set(await slurm.jobs_named(self.config.job_name, self.job_comment)) - known):
                log.warning("cancelling orphaned pilot job %s", job_id)
                await slurm.cancel(job_id)
                self.orphans_cancelled += 1

    async def jobs(self) -> list[dict[str, Any]]:
        """Every live job of this service (adopted, or found by job name and comment)."""
        await self.adopt()
        await self.refresh(force=True)
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
        await self.adopt()
        jobs = set(await slurm.jobs_named(self.config.job_name, self.job_comment))
        for pilot in list(self.pilots.values()):
            jobs.add(pilot.job_id)
            pilot.state = "CANCELLED"
            pilot.sandboxes.clear()
            await self.forget(pilot)
        for job_id in sorted(jobs):
            await slurm.cancel(job_id)
        return len(jobs)

    async def release_idle(self) -> None:
        """Cancel the pilots that host nothing (the rest stay, for a restarted service to adopt)."""
        for pilot in list(self.pilots.values()):
            if not pilot.sandboxes and not pilot.snapshots and pilot.alive:
                await slurm.cancel(pilot.job_id)
                pilot.state = "CANCELLED"
                await self.forget(pilot)

    async def close(self) -> None:
        """Close the connections to the agents; every job stays."""
        for pilot in self.pilots.values():
            if pilot.api is not None:
                await pilot.api.close()


def _complete_json(path: Path) -> bool:
    """Whether ``path`` holds a whole JSON document (an agent from before atomic writes may
    still be writing it when it first appears)."""
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True
