"""The agent's state and operations: sandboxes, jobs, files. The HTTP app is a thin
layer over this, so the same code serves every transport and is easy to test."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import os
import resource
import secrets
import signal
import time
from pathlib import Path, PurePosixPath
from typing import AsyncIterator, Optional

from orchard.agent.cgroups import CgroupManager, SandboxCgroup
from orchard.agent.egress import Egress, choose_egress, start_egress
from orchard.agent.files import SandboxFiles
from orchard.agent.host_ids import HostIdPool, claim_host_ids
from orchard.agent.images import ImageStore
from orchard.agent.inroot import exists_in_root
from orchard.agent.jobs import JobRecord, JobRunner
from orchard.agent.jobtable import JobTable
from orchard.agent.pty_sessions import PtyTable
from orchard.agent.reachable import unreachable_reason
from orchard.agent.reaper import ChildReaper
from orchard.agent.runtimes.api import IsolationRuntime, RuntimeContext
from orchard.agent.runtimes.bwrap import build_host_etc
from orchard.agent.runtimes.helper import helper_path
from orchard.agent.runtimes.mounts import remove_tree
from orchard.agent.sandbox import SandboxState, file_calls_per_sandbox
from orchard.agent.snapshot_ops import SnapshotOperations
from orchard.agent.snapshots import SnapshotState, SnapshotStore
from orchard.agent.settings import AgentSettings
from orchard.errors import (
    ImageRejected, InvalidRequest, JobNotFound, OrchardError, QuotaExceeded, RuntimeUnavailable, SandboxConflict,
    SandboxIdBusy, SandboxLost, SandboxNotFound,
)
from orchard.models import (
    JOB_ID_RULE, ExecRequest, FileContent, FileList, FileUpload, FileUploaded, Job, PatchRequest, PatchResult, QueuedJob,
    Sandbox, SandboxSpec, valid_job_id,
)
from orchard.plugins import collect, emit_event, verify_image
from orchard.quantities import parse_bytes

log = logging.getLogger("orchard.agent")
PURGE_INTERVAL = 30.0


def _write_share_files(settings: AgentSettings, resolv_conf: Optional[str]) -> None:
    """What sandboxes see of /etc: generated passwd, group and hosts, and the name servers of
    the agent's egress (``resolv_conf``; None: the host's, as the ``host`` image shows it)."""
    uid, gid = settings.sandbox_uid, settings.sandbox_gid
    files = {
        "passwd": f"root:x:0:0:root:/root:/bin/bash\nuser:x:{uid}:{gid}:Orchard sandbox:/home/user:/bin/bash\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nuser:x:{gid}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    }
    if resolv_conf is not None:
        files["resolv.conf"] = resolv_conf
    for name, text in files.items():
        path = settings.share_dir / name
        path.write_text(text)
        os.chmod(path, 0o644)
    build_host_etc(settings.share_dir / "etc", files)
    empty = settings.share_dir / "empty"  # masks host-global /proc entries inside sandboxes
    empty.write_bytes(b"")
    os.chmod(empty, 0o444)


FILE_MAX = Path("/proc/sys/fs/file-max")
UNLIMITED_FILES = (1 << 63) - 1


def raise_file_max() -> None:
    """Lift the host-wide open-files limit, as systemd does at boot: a file is charged to the
    memory cgroup of whoever opens it, so each sandbox's memory limit bounds its files, while
    one sandbox at its pids and open-files limits reached a fifth of fs.file-max (500,000
    files in 183 MB), where every other process of the host would get ENFILE."""
    try:
        if int(FILE_MAX.read_text()) < UNLIMITED_FILES:
            FILE_MAX.write_text(f"{UNLIMITED_FILES}\n")
            log.warning("raised fs.file-max to %d (as systemd does): sandboxes' files count against their "
                        "memory limits instead (setting raise_file_max)", UNLIMITED_FILES)
    except (OSError, ValueError) as exc:
        log.warning("could not raise fs.file-max (%s): one sandbox may exhaust the host's open files", exc)


class AgentService(SnapshotOperations):
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.sandboxes: dict[str, SandboxState] = {}
        # Deleted sandboxes whose cgroup still held processes: the group and the host ids it keeps (_sweep_loop).
        self._left_behind: dict[str, tuple[SandboxCgroup, Optional[tuple[int, int]]]] = {}
        self.jobs = JobTable(settings.job_retention_seconds, settings.job_retention_bytes)
        self.reaper = ChildReaper()
        self.started_at = time.time()
        self.last_call = time.monotonic()
        self.file_slots = asyncio.Semaphore(settings.max_file_calls)
        self._tasks: set[asyncio.Task] = set()
        self.runtime: Optional[IsolationRuntime] = None
        self.egress: Optional[Egress] = None  # chosen at start
        self.ptys = PtyTable(settings)
        self.snapshots = SnapshotStore(settings.state_dir / "snapshots", settings.max_snapshots,
                                       parse_bytes(settings.max_snapshot_bytes, "max_snapshot_bytes"))

    # -- life cycle ----------------------------------------------------------------
    async def start(self) -> None:
        settings = self.settings
        settings.make_dirs()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        if settings.raise_file_max and os.geteuid() == 0:
            raise_file_max()
        runtimes = collect("orchard_register_runtimes")
        if settings.runtime not in runtimes:
            raise RuntimeUnavailable(f"unknown runtime {settings.runtime!r}; installed: {', '.join(sorted(runtimes))}")
        runtime_cls = runtimes[settings.runtime]
        reason = runtime_cls.unavailable_reason()
        if reason:
            raise RuntimeUnavailable(f"runtime {settings.runtime!r} cannot run here: {reason}")
        self.reaper.install(asyncio.get_running_loop())
        helper = helper_path(settings.share_dir)
        privileged = os.geteuid() == 0
        owner = (settings.host_uid, settings.host_gid) if privileged else None
        self.host_ids = HostIdPool(settings.host_uid, settings.host_gid, settings.host_id_count)
        if owner and settings.runtime != "direct":  # direct: commands run as we do, no sandbox ids
            try:
                uid, gid, self._host_id_claim = claim_host_ids(settings.host_uid, settings.host_gid,
                                                               settings.host_id_count, settings.host_id_search)
            except OSError as exc:
                raise RuntimeUnavailable(str(exc)) from None
            self.host_ids = HostIdPool(uid, gid, settings.host_id_count)
            owner = (uid, gid)  # owns the unpacked images; sandboxes get the ids after it
        if owner and settings.runtime != "direct":
            for directory in (settings.sandboxes_dir, settings.share_dir, settings.images_dir):
                reason = unreachable_reason(directory, *owner, setting="state_dir")
                if reason:
                    raise RuntimeUnavailable(reason)
        digest = hashlib.sha256(str(settings.state_dir.resolve()).encode()).hexdigest()[:10]
        self.egress = choose_egress(settings, self.reaper, digest)
        if not runtime_cls.runs_in_place:  # direct: the agent's own container is the sandbox
            self.egress = await start_egress(self.egress, settings, self.reaper, digest)
        _write_share_files(settings, self.egress.resolv_conf())
        self.cgroups = CgroupManager(agent_name=f"{settings.state_dir.name}-{digest}",  # stable across restarts
                                     below_own=settings.cgroups_below_own, total_pids=settings.sandbox_pids_total())
        self._clean_leftovers()
        cache = settings.images_dir / str(owner[0]) if owner else settings.images_dir  # trees belong to their owner
        images = ImageStore(cache, owner, settings.image_policy(), self.reaper)
        context = RuntimeContext(settings=settings, helper=helper, cgroups=self.cgroups, images=images,
                                 reaper=self.reaper, egress=self.egress)
        self.runtime = runtime_cls(context)
        self.jobs_runner = JobRunner(self.reaper, helper, settings.max_output_bytes)
        self._spawn(self._purge_loop())
        if self.cgroups.available:
            self._spawn(self._sweep_loop(settings.cgroup_sweep_seconds))
        if settings.idle_exit_seconds is not None:
            self._spawn(self._idle_exit_loop(settings.idle_exit_seconds))

    def _clean_leftovers(self) -> None:
        """A previous agent on this state dir died: its sandboxes died with it (their
        holders run with --die-with-parent); remove what they left on the host."""
        for entry in self.settings.sandboxes_dir.iterdir():
            remove_tree(entry)
        self.snapshots.clean_leftovers()
        self._remove_leftover_cgroups()
        self.cgroups.remove_dead_agents_trees()  # and those of agents on other state dirs that died

    def _remove_leftover_cgroups(self, patience: float = 2.0) -> None:
        """Kill what still runs in cgroups no sandbox owns and remove them (processes of a
        killed agent may take a moment to die, so retry for a while)."""
        deadline = time.monotonic() + patience
        while True:
            owned = {sandbox.sandbox_id for sandbox in self.sandboxes.values()}
            stale = [SandboxCgroup({"leftover": g}) for g in self.cgroups.leftovers() if g.name not in owned]
            for group in stale:
                group.kill_all()
            removed = [group.remove() for group in stale]  # each one: a stuck group must not keep the rest
            if all(removed) or time.monotonic() > deadline:
                return
            time.sleep(0.05)

    async def stop(self) -> None:
        await asyncio.gather(*(self.delete(sid) for sid in list(self.sandboxes)), return_exceptions=True)
        self.snapshots.delete_all()
        for task in self._tasks:
            task.cancel()
        self._remove_leftover_cgroups()
        self.cgroups.remove_bases()
        if self.egress is not None and self.runtime is not None and not self.runtime.runs_in_place:
            await self.egress.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def touch(self) -> None:
        """A caller was here (the app calls this on every request)."""
        self.last_call = time.monotonic()

    def idle_for(self) -> float:
        """Seconds with no sandbox, no running command and no call (0 while busy)."""
        if self.sandboxes or self.jobs.running() or self.ptys.sessions:
            return 0.0
        return time.monotonic() - self.last_call

    async def _idle_exit_loop(self, limit: float) -> None:
        """An agent nobody uses exits (as on SIGTERM), so repeated runs do not pile up
        idle agents; the local backend starts a new one on the next call."""
        while True:
            await asyncio.sleep(min(limit / 4, 10.0))
            if self.idle_for() >= limit:
                log.warning("no sandbox and no call for %.0f s: exiting", limit)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    async def _purge_loop(self) -> None:
        while True:
            await asyncio.sleep(PURGE_INTERVAL)
            self.jobs.purge_expired()

    def _leave_behind(self, sandbox_id: str, group: SandboxCgroup, host_ids: Optional[tuple[int, int]]) -> None:
        """Hand a group a delete could not remove, with the host ids it keeps, to the sweep
        (no sandbox of that id is made again until the group is gone: see ``create``). A lost
        sandbox comes here twice, when its holder died and when it is deleted; only the first
        time with its ids."""
        if sandbox_id in self._left_behind and host_ids is None:
            return
        self._left_behind[sandbox_id] = (group, host_ids)

    async def _sweep_loop(self, interval: float) -> None:
        """A sandbox this agent deleted whose killed processes had not left its cgroup in
        time (``holder.CGROUP_REMOVE_PATIENCE``) left that cgroup behind, and kept its host
        ids: empty and remove such groups while the agent runs, not only at its next start
        or stop (a training run's agent may live for days and go through thousands of
        sandboxes), and free the ids once a group is gone. Only groups this agent left
        behind: a group it does not know may be another live agent's on the same state dir."""
        while True:
            await asyncio.sleep(interval)
            for sandbox_id in list(self._left_behind):
                self._sweep(sandbox_id)

    def _sweep(self, sandbox_id: str) -> bool:
        """Empty and remove the group ``sandbox_id``'s delete left behind; True once it is gone."""
        group, held = self._left_behind[sandbox_id]
        try:
            group.kill_all()
            if not group.remove():
                return False
        except Exception:
            log.exception("sandbox %s: removing its leftover cgroup failed; the sweep tries again", sandbox_id)
            return False
        del self._left_behind[sandbox_id]
        if held is not None:
            self.host_ids.release(held)
        log.info("sandbox %s: its leftover cgroup is removed", sandbox_id)
        return True

    # -- sandboxes -----------------------------------------------------------------
    def _get(self, sandbox_id: str) -> SandboxState:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return sandbox

    def _ready(self, sandbox_id: str) -> SandboxState:
        sandbox = self._get(sandbox_id)
        sandbox.check_ready()
        return sandbox

    async def create(self, spec: SandboxSpec) -> Sandbox:
        sandbox_id = spec.sandbox_id or f"sbx-{secrets.token_hex(6)}"
        existing = self.sandboxes.get(sandbox_id)
        if existing is not None:
            if existing.spec.identity() != spec.identity():
                raise SandboxConflict(f"sandbox {sandbox_id!r} already exists with a different spec")
            await self._wait_ready(existing, spec.timeout or self.settings.ready_timeout)
            return existing.to_model()
        base = self._fork_base(spec)
        reason = verify_image(spec.image, self.settings.image_policy())  # every runtime's images, once, here
        if reason:
            raise ImageRejected(f"image {spec.image!r} refused by policy: {reason}")
        if sandbox_id in self._left_behind and not self._sweep(sandbox_id):  # its directories would be shared
            raise SandboxIdBusy(f"sandbox id {sandbox_id!r}: the processes of the deleted sandbox of that id have "
                                "not left its cgroup yet; retry later, or use another id")
        if len(self.sandboxes) >= self.settings.max_sandboxes:
            raise QuotaExceeded(f"this agent already hosts {len(self.sandboxes)} sandboxes (max_sandboxes)")
        assert self.runtime is not None
        sandbox = SandboxState(spec=spec.model_copy(update={"sandbox_id": sandbox_id}), sandbox_id=sandbox_id,
                               runtime=self.runtime.name, state_dir=self.settings.sandboxes_dir / sandbox_id, base=base,
                               file_slots=asyncio.Semaphore(file_calls_per_sandbox(self.settings.max_file_calls)))
        self.sandboxes[sandbox_id] = sandbox
        if base is not None:
            self.snapshots.use(base, sandbox_id)
        try:
            if os.geteuid() == 0:
                sandbox.host_ids = self.host_ids.take()
                if sandbox.host_ids is None:
                    raise QuotaExceeded(f"every one of the {self.settings.host_id_count} sandbox host ids is in use "
                                        "(host_id_count)")
            await self.runtime.start(sandbox)
        except Exception as exc:
            sandbox.status = "failed"
            sandbox.status_message = exc.message if isinstance(exc, OrchardError) else f"{type(exc).__name__}: {exc}"
            sandbox.ready_event.set()
            emit_event({"type": "failed", "sandbox_id": sandbox_id, "time": time.time(), "reason": sandbox.status_message})
            await self._release(sandbox)
            del self.sandboxes[sandbox_id]
            if isinstance(exc, OrchardError):
                raise
            log.exception("creating sandbox %s failed", sandbox_id)
            raise RuntimeUnavailable(f"creating sandbox failed: {sandbox.status_message}") from exc
        if sandbox.holder_exit is not None:
            sandbox.holder_exit.add_done_callback(lambda fut: self._holder_exited(sandbox, fut))
        sandbox.status = "ready"
        sandbox.ready_event.set()
        emit_event({"type": "ready", "sandbox_id": sandbox_id, "time": time.time()})
        return sandbox.to_model()

    def _fork_base(self, spec: SandboxSpec) -> Optional[SnapshotState]:
        """The snapshot a fork starts from (None for a plain create)."""
        if spec.snapshot is None:
            return None
        base = self.snapshots.get(spec.snapshot)
        if spec.image != base.image:
            raise InvalidRequest(f"image: a fork of snapshot {base.snapshot_id!r} runs its image {base.image!r}, "
                                 f"not {spec.image!r}")
        return base

    def _holder_exited(self, sandbox: SandboxState, future: "asyncio.Future[int]") -> None:
        if sandbox.deleting or sandbox.restarting or sandbox.status != "ready":
            return
        code = future.result() if not future.cancelled() else -1
        reason = f"sandbox holder exited (code {code})"
        if sandbox.cgroup is not None and sandbox.cgroup.oom_kills():
            reason += "; the memory limit was hit (OOM)"
        sandbox.status, sandbox.status_message = "lost", reason
        self.ptys.end_sandbox(sandbox.sandbox_id, SandboxLost(f"sandbox {sandbox.sandbox_id!r} was lost: {reason}"))
        log.warning("sandbox %s lost: %s", sandbox.sandbox_id, reason)
        emit_event({"type": "lost", "sandbox_id": sandbox.sandbox_id, "time": time.time(), "reason": reason})
        self._spawn(self._release(sandbox))

    async def _release(self, sandbox: SandboxState) -> None:
        assert self.runtime is not None
        try:
            await self.runtime.stop(sandbox)
        except Exception:
            log.exception("cleaning up sandbox %s failed", sandbox.sandbox_id)
        if sandbox.cgroup is not None and sandbox.cgroup.exists():  # its killed processes were slow to leave
            self._leave_behind(sandbox.sandbox_id, sandbox.cgroup, sandbox.host_ids)
        elif sandbox.host_ids is not None:  # free for another sandbox only once nothing of this one runs
            self.host_ids.release(sandbox.host_ids)
        sandbox.host_ids = None
        if sandbox.base is not None:
            self.snapshots.drop(sandbox.base, sandbox.sandbox_id)
            sandbox.base = None

    async def _wait_ready(self, sandbox: SandboxState, timeout: float) -> None:
        try:
            await asyncio.wait_for(sandbox.ready_event.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def wait(self, sandbox_id: str, timeout: float) -> Sandbox:
        sandbox = self._get(sandbox_id)
        await self._wait_ready(sandbox, timeout)
        return sandbox.to_model()

    def get(self, sandbox_id: str) -> Sandbox:
        return self._get(sandbox_id).to_model()

    def list(self, status: Optional[str] = None, labels: Optional[dict[str, str]] = None) -> list[Sandbox]:
        found = [sandbox.to_model() for sandbox in self.sandboxes.values()]
        return [s for s in found if (status is None or s.status == status)
                and all(s.labels.get(k) == v for k, v in (labels or {}).items())]

    async def delete(self, sandbox_id: str) -> None:
        sandbox = self._get(sandbox_id)
        if sandbox.deleting:
            return
        sandbox.deleting = True
        self.ptys.end_sandbox(sandbox_id, SandboxLost(f"sandbox {sandbox_id!r} was deleted"))
        if sandbox.status == "pending":
            await sandbox.ready_event.wait()  # let creation finish, then tear down what it built
        async with sandbox.lifecycle:  # a snapshot or reset under way finishes first
            await self._release(sandbox)
        sandbox.status = "deleted"
        self.sandboxes.pop(sandbox_id, None)
        self.jobs.drop_sandbox(sandbox_id)
        emit_event({"type": "deleted", "sandbox_id": sandbox_id, "time": time.time()})

    def heartbeat(self, sandbox_id: str) -> Sandbox:
        return self._get(sandbox_id).to_model()

    # -- exec ----------------------------------------------------------------------
    def _resolve_cwd(self, sandbox: SandboxState, cwd: Optional[str]) -> str:
        assert sandbox.placement is not None
        default = sandbox.placement.default_cwd
        if cwd is None:
            return default
        full = str(PurePosixPath(default) / cwd)
        if not exists_in_root(sandbox.placement.root, full, directory=True):
            if not os.path.exists(sandbox.placement.root):  # its holder just died; the reaper has not seen it yet
                raise SandboxLost(f"sandbox {sandbox.sandbox_id!r} was lost: its holder exited")
            raise InvalidRequest(f"cwd {full!r} does not exist in sandbox {sandbox.sandbox_id!r} (or is not a directory)")
        return full

    def submit(self, sandbox_id: str, request: ExecRequest, idempotency_key: Optional[str] = None) -> JobRecord:
        """Queue a command; the same idempotency key returns the same job, never a second run."""
        if idempotency_key and not valid_job_id(idempotency_key):
            raise InvalidRequest(f"Idempotency-Key header {JOB_ID_RULE}")
        key = request.job_id or idempotency_key or None
        record = self.jobs.get(key) if key is not None else None
        if record is not None:
            if record.job.sandbox_id != sandbox_id or record.job.command != request.command_text():
                raise SandboxConflict(f"job id {key!r} is already in use; pick a new job id for a new command")
            return record
        sandbox = self._ready(sandbox_id)
        cwd = self._resolve_cwd(sandbox, request.cwd)
        job_id = key or f"job-{secrets.token_hex(8)}"
        job = Job(job_id=job_id, sandbox_id=sandbox_id, command=request.command_text(), status="queued",
                  created_at=time.time())
        record = JobRecord(job=job, request=request)
        self.jobs.add(record)
        assert self.runtime is not None
        task = self._spawn(self.jobs_runner.run(sandbox, self.runtime, record, cwd))
        task.add_done_callback(lambda _: self.jobs.finished(record))
        return record

    async def exec(self, sandbox_id: str, request: ExecRequest, idempotency_key: Optional[str] = None) -> Job | QueuedJob:
        record = self.submit(sandbox_id, request, idempotency_key)
        if not request.wait:
            return QueuedJob(job_id=record.job.job_id, status=record.job.status)
        await record.done.wait()
        return record.job

    def stream(self, sandbox_id: str, request: ExecRequest, idempotency_key: Optional[str] = None) -> AsyncIterator[dict]:
        return self.jobs_runner.stream(self.submit(sandbox_id, request, idempotency_key))

    def job(self, job_id: str) -> Job:
        record = self.jobs.get(job_id)
        if record is None:
            raise JobNotFound(f"job {job_id!r} not found")
        return record.job

    async def wait_job(self, job_id: str, timeout: float) -> Job:
        """The job when it is done, or as it is (status "running") when ``timeout`` ends."""
        record = self.jobs.get(job_id)
        if record is None:
            raise JobNotFound(f"job {job_id!r} not found")
        try:
            await asyncio.wait_for(asyncio.shield(record.done.wait()), timeout)
        except asyncio.TimeoutError:
            pass
        return record.job

    # -- files ---------------------------------------------------------------------
    def _files(self, sandbox: SandboxState) -> SandboxFiles:
        assert self.runtime is not None
        return SandboxFiles(self.runtime, sandbox, self.reaper, self.file_slots, self.settings.file_call_stall_seconds)

    async def upload(self, sandbox_id: str, upload: FileUpload) -> FileUploaded:
        sandbox = self._ready(sandbox_id)
        try:
            data = base64.b64decode(upload.content, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("content is not valid base64") from None

        async def chunks() -> AsyncIterator[bytes]:
            yield data

        path, size = await self._files(sandbox).write(upload.path, chunks(), upload.mode)
        return FileUploaded(path=path, size=size)

    async def download(self, sandbox_id: str, path: str) -> FileContent:
        files = self._files(self._ready(sandbox_id))
        full, data = await files.read(path, self.settings.max_inline_file_bytes)
        return FileContent(path=full, content=base64.b64encode(data).decode(), size=len(data))

    async def upload_raw(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes],
                         mode: Optional[int] = None) -> FileUploaded:
        """Write a file from a byte stream (no JSON, no base64; the loop stays free)."""
        full, size = await self._files(self._ready(sandbox_id)).write(path, chunks, mode)
        return FileUploaded(path=full, size=size)

    async def download_raw(self, sandbox_id: str, path: str) -> tuple[Optional[int], AsyncIterator[bytes]]:
        """(size, chunks) of a file, read as it is sent. Files whose size the kernel does not
        know (most of /proc reads 0) are sent without a length."""
        _, size, chunks = await self._files(self._ready(sandbox_id)).open_read(path)
        return (size or None), chunks

    async def list_files(self, sandbox_id: str, path: str, offset: int = 0, limit: Optional[int] = None) -> FileList:
        """One page of a directory, entries sorted by name."""
        limit = min(limit or self.settings.max_list_entries, self.settings.max_list_entries)
        full, total, entries = await self._files(self._ready(sandbox_id)).list(path, offset, limit)
        following = offset + limit
        return FileList(path=full, files=entries, total=total, offset=offset,
                        next_offset=following if following < total else None)

    async def apply_patch(self, sandbox_id: str, patch: PatchRequest) -> PatchResult:
        request = ExecRequest(command="git apply --whitespace=nowarn -", stdin=patch.patch,
                              timeout_seconds=patch.timeout_seconds or 60, wait=True)
        job = await self.exec(sandbox_id, request)
        assert isinstance(job, Job)
        return PatchResult(success=job.exit_code == 0 and job.error_type is None, stdout=job.stdout,
                           stderr=job.stderr, exit_code=job.exit_code)

    # -- health --------------------------------------------------------------------
    def resources(self) -> dict:
        counts: dict[str, int] = {}
        for sandbox in self.sandboxes.values():
            counts[sandbox.status] = counts.get(sandbox.status, 0) + 1
        running = self.jobs.running()
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return {
            "runtime": self.settings.runtime, "sandboxes": counts, "max_sandboxes": self.settings.max_sandboxes,
            "jobs_running": running, "cpus": os.cpu_count(),
            "memory_available_bytes": int(fields["MemAvailable"].split()[0]) * 1024,
            "cgroups": self.cgroups.mode, "uptime_seconds": time.time() - self.started_at,
            "network": self.egress.describe() if self.egress is not None else None,
        }
