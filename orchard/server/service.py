"""The server's operations: records in the store, life cycle through the backend, commands
and files forwarded to the sandbox's agent. No backend-specific code lives here.

The agent owns per-sandbox serialization; the server holds no lock of its own around a
sandbox (one would interleave with callers on the direct path), only a global bound on
commands in flight.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, AsyncIterator, Generator, Optional

from fastapi.exceptions import RequestValidationError

from orchard.agent.tokens import sandbox_token
from orchard.backends.api import Backend
from orchard.client.http import MAX_JSON_ANSWER, ApiClient
from orchard.download_cut import DownloadCut
from orchard.errors import (
    AgentUnreachable, JobNotFound, OrchardError, SandboxConflict, SandboxLost, SandboxNotFound, SandboxNotReady,
    StoreRecordDamaged, WaitTimeout,
)
from orchard.models import (
    JOB_ID_RULE, ExecRequest, FileUpload, Job, PatchRequest, QueuedJob, Sandbox, SandboxSpec, Snapshot, SnapshotRequest,
    valid_job_id,
)
from orchard.plugins import emit_event
from orchard.server.config import ServerConfig
from orchard.server.observability import Metrics
from orchard.server.store import SandboxRecord, Store

log = logging.getLogger("orchard.server")
OWNER_LABEL = "orchard-server"
LOST_REASON = "the backend no longer has this sandbox (agent restarted, pod evicted, job cancelled or node lost)"


class ServerService:
    def __init__(self, config: ServerConfig, backend: Backend, store: Store, metrics: Metrics) -> None:
        self.config = config
        self.backend = backend
        self.store = store
        self.metrics = metrics
        self.server_id = store.server_id()
        self.exec_slots = asyncio.Semaphore(config.max_concurrent_exec)
        self._agents: dict[tuple[str, Optional[str]], ApiClient] = {}
        self._creating: dict[str, asyncio.Event] = {}
        self._last_seen: dict[str, float] = {}
        self._wall_at_start, self._monotonic_at_start = time.time(), time.monotonic()

    def now(self) -> float:
        """Seconds since the epoch as read once at start and advanced by the monotonic clock
        since: TTLs are measured on it, so a step of the wall clock (NTP, `date -s`) neither
        reaps every live sandbox nor keeps idle ones alive."""
        return self._wall_at_start + (time.monotonic() - self._monotonic_at_start)

    async def close(self) -> None:
        self.flush_heartbeats()
        for api in self._agents.values():
            await api.close()
        await self.backend.shutdown()
        await self.backend.close()
        self.store.close()

    # -- records -------------------------------------------------------------------
    def record(self, sandbox_id: str) -> SandboxRecord:
        record = self.store.get_sandbox(sandbox_id)
        if record is None:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return record

    def usable(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox that can take calls; every call counts as a heartbeat."""
        record = self.record(sandbox_id)
        status = record.sandbox.status
        if status == "lost":
            raise SandboxLost(f"sandbox {sandbox_id!r} was lost: {record.sandbox.status_message}")
        if status != "ready":
            raise SandboxNotReady(f"sandbox {sandbox_id!r} is {status}")
        self.touch(sandbox_id)
        return record

    def touch(self, sandbox_id: str) -> None:
        """Note a call on a sandbox; written to the store in batches (see flush_heartbeats)."""
        self._last_seen[sandbox_id] = self.now()

    def flush_heartbeats(self) -> None:
        seen, self._last_seen = self._last_seen, {}
        try:
            self.store.touch_many(seen)
        except BaseException:  # kept for the next flush: a lost heartbeat would get a busy sandbox reaped
            for sandbox_id, when in seen.items():
                self._last_seen[sandbox_id] = max(when, self._last_seen.get(sandbox_id, when))
            raise

    def mark_lost(self, record: SandboxRecord, reason: str) -> None:
        if record.sandbox.status == "lost":
            return
        # The jobs first: if a write fails, the sandbox is not yet "lost" and the next round
        # does it all again, rather than leave its jobs unfinished for ever.
        for job in self.store.unfinished_jobs(record.sandbox.sandbox_id):
            self.store.put_job(job.model_copy(update={
                "status": "failed", "error_type": "sandbox_lost", "error": f"sandbox lost: {reason}",
                "completed_at": time.time()}))
        record.sandbox = record.sandbox.model_copy(update={"status": "lost", "ready": False, "status_message": reason})
        self.store.put_sandbox(record)
        self.metrics.reconciler.labels("marked_lost").inc()
        log.warning("sandbox lost", extra={"fields": {"sandbox_id": record.sandbox.sandbox_id, "reason": reason}})
        emit_event({"type": "lost", "sandbox_id": record.sandbox.sandbox_id, "time": time.time(), "reason": reason})

    async def confirm_lost(self, record: SandboxRecord) -> Optional[str]:
        """Ask the backend whether a sandbox still exists; mark it lost (and say why) if not."""
        sandbox_id = record.sandbox.sandbox_id
        try:
            seen = await self.backend.status(sandbox_id)
        except SandboxNotFound:
            reason = LOST_REASON
        else:
            if seen.status != "lost":
                return None
            reason = seen.status_message or "lost"
        self.mark_lost(record, reason)
        return reason

    # -- life cycle ----------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Idempotent for the same spec, also across replicas on one shared store: a create
        runs while this server holds the id (``Store.claim``); another replica's create of
        that id waits for it; a pending record whose creator died is created again (the
        backend's create is idempotent for the same spec) rather than left pending."""
        sandbox_id = spec.sandbox_id or f"sbx-{secrets.token_hex(6)}"
        while sandbox_id in self._creating:  # this server is creating (or dropping) it: wait for the outcome
            self._same_spec(sandbox_id, spec)
            await self._creating[sandbox_id].wait()
        self._creating[sandbox_id] = asyncio.Event()
        try:
            await self._claim(sandbox_id, spec)
            try:
                existing = self._same_spec(sandbox_id, spec)
                if existing is not None and existing.sandbox.status != "pending":
                    return existing.sandbox
                return await self._create(sandbox_id, spec)
            finally:
                self.store.release(sandbox_id)
        finally:
            self._creating.pop(sandbox_id).set()

    async def drop_abandoned(self, sandbox_id: str) -> bool:
        """Delete a pending sandbox whose creator died (no replica holds its id any more) and
        whose caller, never told it exists, did not ask again; whether it was dropped."""
        if sandbox_id in self._creating:
            return False
        self._creating[sandbox_id] = asyncio.Event()
        try:
            if not self.store.claim(sandbox_id):
                return False  # a live replica is creating it
            try:
                record = self.store.get_sandbox(sandbox_id)
                if record is None or record.sandbox.status != "pending":
                    return False
                try:
                    await self.backend.delete(sandbox_id)
                except SandboxNotFound:
                    pass
                return self.store.remove_sandbox(sandbox_id)  # False: another replica dropped it meanwhile
            finally:
                self.store.release(sandbox_id)
        finally:
            self._creating.pop(sandbox_id).set()

    def _same_spec(self, sandbox_id: str, spec: SandboxSpec) -> Optional[SandboxRecord]:
        existing = self.store.get_sandbox(sandbox_id)
        if existing is not None and existing.spec.identity() != spec.identity():
            raise SandboxConflict(f"sandbox {sandbox_id!r} already exists with a different spec")
        return existing

    async def _claim(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Wait (bounded) while another replica creates this id."""
        deadline = time.monotonic() + (spec.timeout or 600) + 60
        while not self.store.claim(sandbox_id):
            self._same_spec(sandbox_id, spec)
            if time.monotonic() > deadline:
                raise WaitTimeout(f"sandbox {sandbox_id!r} is still being created by another server replica")
            await asyncio.sleep(0.05)

    async def _create(self, sandbox_id: str, spec: SandboxSpec) -> Sandbox:
        spec = spec.model_copy(update={"sandbox_id": sandbox_id})
        now = self.now()
        pending = Sandbox(sandbox_id=sandbox_id, image=spec.image, status="pending", block_network=spec.block_network,
                          cpu=spec.cpu, memory=spec.memory, disk=spec.disk, pids=spec.pids, labels=spec.labels,
                          backend=self.backend.name, created_at=now)
        self.store.put_sandbox(SandboxRecord(spec, pending, now))
        start = time.perf_counter()
        owned = spec.model_copy(update={"labels": {**spec.labels, OWNER_LABEL: self.server_id}})
        try:
            created = await self.backend.create(owned)
        except BaseException:
            self.store.remove_sandbox(sandbox_id)
            raise
        self.metrics.create_seconds.observe(time.perf_counter() - start)
        # created_at on the server's clock, as TTLs and the lost grace are measured on it
        sandbox = created.model_copy(update={"labels": spec.labels, "backend": self.backend.name, "created_at": now,
                                             "agent_url": None, "agent_token": None})
        self.store.put_sandbox(SandboxRecord(spec, sandbox, self.now()))
        emit_event({"type": "ready", "sandbox_id": sandbox_id, "time": time.time()})
        endpoint = await self.backend.endpoint(sandbox_id)
        if endpoint.token is None or created.incarnation is None:
            return sandbox
        # Only the creator hears of the direct path; GET never shows the token again.
        return sandbox.model_copy(update={"agent_url": endpoint.url,
                                          "agent_token": sandbox_token(endpoint.token, sandbox_id,
                                                                       created.incarnation)})

    def get(self, sandbox_id: str) -> Sandbox:
        record = self.record(sandbox_id)
        self.touch(sandbox_id)
        return record.sandbox

    async def wait(self, sandbox_id: str, timeout: float) -> Sandbox:
        event = self._creating.get(sandbox_id)
        if event is not None:
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                raise WaitTimeout(f"sandbox {sandbox_id!r} not ready after {timeout:g}s") from None
        return self.get(sandbox_id)

    def heartbeat(self, sandbox_id: str) -> Sandbox:
        return self.get(sandbox_id)

    def list(self, status: Optional[str] = None, labels: Optional[dict[str, str]] = None) -> list[Sandbox]:
        found = [r.sandbox for r in self.store.list_sandboxes()]
        if status:
            found = [s for s in found if s.status == status]
        for key, value in (labels or {}).items():
            found = [s for s in found if s.labels.get(key) == value]
        return found

    async def delete(self, sandbox_id: str, reason: str = "deleted") -> bool:
        """Delete the sandbox and its record; True if this call removed the record, False if
        another call (another replica's reconciler, on a shared store) removed it meanwhile."""
        try:
            record: Optional[SandboxRecord] = self.record(sandbox_id)
        except StoreRecordDamaged:  # its sandbox may still run: delete what the id names, and the record
            record = None
        if record is None or record.sandbox.status != "lost":
            try:
                await self.backend.delete(sandbox_id)
            except SandboxNotFound:
                pass
        removed = self.store.remove_sandbox(sandbox_id)
        self._last_seen.pop(sandbox_id, None)
        if removed:
            emit_event({"type": "deleted", "sandbox_id": sandbox_id, "time": time.time(), "reason": reason})
        return removed

    # -- agents --------------------------------------------------------------------
    async def agent(self, sandbox_id: str) -> ApiClient:
        endpoint = await self.backend.endpoint(sandbox_id)
        key = (endpoint.url, endpoint.token)
        api = self._agents.get(key)
        if api is None:
            api = self._agents[key] = ApiClient(endpoint.url, endpoint.token, retries=2)
        return api

    async def forward(self, record: SandboxRecord, method: str, path: str, **kwargs: Any) -> Any:
        """A call to the sandbox's agent; a sandbox that vanished underneath turns into 410."""
        try:
            return await (await self.agent(record.sandbox.sandbox_id)).request(method, path, **kwargs)
        except (AgentUnreachable, SandboxNotFound, SandboxLost) as exc:
            reason = await self.confirm_lost(record)
            if reason is None:
                raise exc
            raise SandboxLost(f"sandbox {record.sandbox.sandbox_id!r} was lost: {reason}") from None

    # -- exec ----------------------------------------------------------------------
    def _job_key(self, sandbox_id: str, request: ExecRequest,
                 idempotency_key: Optional[str]) -> tuple[Optional[str], Optional[Job]]:
        """The request's job id (body ``job_id``, else the ``Idempotency-Key`` header) and the
        job stored under it, checked before anything is stored or sent to the agent."""
        if idempotency_key:  # an empty header counts as none, as it always did
            if not valid_job_id(idempotency_key):
                raise RequestValidationError([{"loc": ("header", "idempotency-key"), "msg": JOB_ID_RULE,
                                               "type": "value_error"}])
        key = request.job_id or idempotency_key or None
        known = self.store.get_job(key) if key is not None else None
        if known is not None and (known.sandbox_id != sandbox_id or known.command != request.command_text()):
            # The same answer whatever the other use was: nothing about its sandbox or command.
            raise SandboxConflict(f"job id {key!r} is already in use; pick a new job id for a new command")
        return key, known

    async def exec(self, sandbox_id: str, request: ExecRequest, idempotency_key: Optional[str]) -> bytes:
        """Run a command through the sandbox's agent; returns the agent's JSON answer as is."""
        record = self.usable(sandbox_id)
        key, known = self._job_key(sandbox_id, request, idempotency_key)
        if known is not None and known.done:
            answer = known if request.wait else QueuedJob(job_id=known.job_id, status=known.status)
            return answer.model_dump_json().encode()
        job_id = key or f"job-{secrets.token_hex(8)}"
        body = request.model_dump(mode="json")
        body["job_id"] = job_id  # the agent is idempotent on it: a retry never runs twice
        created_at, start = time.time(), time.perf_counter()
        async with self.exec_slots:
            answer = await self.forward(record, "POST", f"/sandboxes/{sandbox_id}/exec", json_body=body,
                                        timeout=request.effective_timeout() + 30, raw_response=True,
                                        answer_cap=MAX_JSON_ANSWER)  # an agent beside hostile code: bounded
        if request.wait:
            self.metrics.exec_seconds.observe(time.perf_counter() - start)
            self.store.put_job_json(sandbox_id, answer)
        elif known is None:
            # Stored once the agent took it (a refused request leaves no record that would stay
            # "queued" forever) and before the caller hears the id, so it can be polled even
            # after a server restart.
            self.store.put_job(Job(job_id=job_id, sandbox_id=sandbox_id, command=request.command_text(),
                                   status="queued", created_at=created_at))
        return answer

    def stream(self, sandbox_id: str, request: ExecRequest, idempotency_key: Optional[str] = None) -> CommandStream:
        """The command's events. What can be checked at once (the sandbox, the job id) is checked
        when this is called, so the route answers 404, 409 or 422 rather than a 200 it then cuts;
        the agent takes the command when the result is awaited (or, at the latest, on the first
        event), so a route that awaits it answers the agent's refusal with its status as well."""
        record = self.usable(sandbox_id)
        key, known = self._job_key(sandbox_id, request, idempotency_key)
        body = request.model_dump(mode="json")
        body["job_id"] = key or f"job-{secrets.token_hex(8)}"
        body["wait"] = False
        return CommandStream(self, record, request, body, known)

    async def wait_job(self, job_id: str, timeout: float) -> Job:
        return await self.job(job_id, wait=timeout)

    async def job(self, job_id: str, wait: Optional[float] = None) -> Job:
        """A job from the store, brought up to date from its agent while it is not done."""
        if not valid_job_id(job_id):  # never stored (see _job_key), and no path to send on to an agent
            raise JobNotFound(f"job {job_id[:80]!r} not found")
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFound(f"job {job_id!r} not found")
        if job.done:
            return job
        record = self.store.get_sandbox(job.sandbox_id)
        if record is None or record.sandbox.status == "lost":
            return self.store.get_job(job_id) or job
        path, params = f"/jobs/{job_id}", None
        if wait is not None:
            path, params = f"/jobs/{job_id}/wait", {"timeout": wait}
        try:
            fresh = Job(**await self.forward(record, "GET", path, params=params, timeout=(wait or 0) + 30))
        except JobNotFound:
            if await self.confirm_lost(record) is None:
                # Every job stored here was taken by the agent first, so the agent forgot it (its
                # record expired), or an older server stored it for a request the agent refused:
                # it will never move on, so it ends rather than stay unfinished for ever.
                self.store.put_job(job.model_copy(update={
                    "status": "failed", "error_type": "internal", "completed_at": time.time(),
                    "error": "the sandbox's agent has no record of this job (it expired, or the agent refused it)"}))
            return self.store.get_job(job_id) or job
        except SandboxLost:
            return self.store.get_job(job_id) or job
        self.store.put_job(fresh)
        return fresh

    # -- snapshots (backends with the capability) --------------------------------------
    async def snapshot(self, sandbox_id: str, request: SnapshotRequest) -> Snapshot:
        self.usable(sandbox_id)
        snapshot = await self.backend.snapshot(sandbox_id, request)
        emit_event({"type": "snapshot", "sandbox_id": sandbox_id, "snapshot_id": snapshot.snapshot_id,
                    "time": time.time()})
        return snapshot

    async def reset(self, sandbox_id: str) -> Sandbox:
        record = self.usable(sandbox_id)
        await self.backend.reset(sandbox_id)
        return record.sandbox

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return await self.backend.get_snapshot(snapshot_id)

    async def list_snapshots(self) -> list[Snapshot]:
        return await self.backend.list_snapshots()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.backend.delete_snapshot(snapshot_id)

    # -- files ---------------------------------------------------------------------
    async def _files(self, sandbox_id: str, method: str, suffix: str, **kwargs: Any) -> Any:
        record = self.usable(sandbox_id)
        return await self.forward(record, method, f"/sandboxes/{sandbox_id}/{suffix}", **kwargs)

    async def apply_patch(self, sandbox_id: str, patch: PatchRequest) -> dict:
        return await self._files(sandbox_id, "POST", "apply_patch", json_body=patch.model_dump(),
                                 timeout=(patch.timeout_seconds or 60) + 30)

    async def upload(self, sandbox_id: str, upload: FileUpload) -> dict:
        return await self._files(sandbox_id, "POST", "files", json_body=upload.model_dump())

    async def download(self, sandbox_id: str, path: str) -> dict:
        return await self._files(sandbox_id, "GET", "files", params={"path": path})

    async def list_files(self, sandbox_id: str, path: str, offset: int = 0, limit: Optional[int] = None) -> dict:
        params: dict[str, Any] = {"path": path, "offset": offset, **({"limit": limit} if limit else {})}
        return await self._files(sandbox_id, "GET", "files/list", params=params)

    async def upload_raw(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes], mode: Optional[int]) -> dict:
        """The body goes on to the agent as it arrives: the server never holds a whole file."""
        return await self._files(sandbox_id, "PUT", "files/raw", params={"path": path, "mode": mode}, content=chunks,
                                 timeout=600)

    async def download_raw(self, sandbox_id: str, path: str) -> tuple[Optional[int], AsyncIterator[bytes]]:
        """The agent's answer is passed on as it arrives."""
        record = self.usable(sandbox_id)
        api = await self.agent(sandbox_id)
        try:
            size, chunks = await api.download(f"/sandboxes/{sandbox_id}/files/raw", params={"path": path}, timeout=600)
        except (AgentUnreachable, SandboxNotFound, SandboxLost) as exc:
            reason = await self.confirm_lost(record)
            if reason is None:
                raise exc
            raise SandboxLost(f"sandbox {sandbox_id!r} was lost: {reason}") from None
        return size, _passed_on(chunks, sandbox_id)

    async def resources(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for record in self.store.list_sandboxes():
            counts[record.sandbox.status] = counts.get(record.sandbox.status, 0) + 1
        try:
            backend = await self.backend.resources()
        except OrchardError as exc:
            backend = {"error": exc.message}
        return {"backend": self.backend.name, "sandboxes": counts, "capacity": backend,
                "max_concurrent_exec": self.config.max_concurrent_exec}


async def _passed_on(chunks: AsyncIterator[bytes], sandbox_id: str) -> AsyncIterator[bytes]:
    """The agent's chunks; a body the agent cut (its sandbox deleted under the download, the
    agent gone) is cut here too, said in one line (``orchard.download_cut``)."""
    try:
        async for chunk in chunks:
            yield chunk
    except OrchardError as exc:
        log.warning("sandbox %s: a download was cut short: %s", sandbox_id, exc)
        raise DownloadCut(str(exc)) from exc
    finally:  # a client gone mid-download closes this generator: the agent's response goes with it
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


class CommandStream:
    """The events of one command streamed through the server (see ``ServerService.stream``):
    ``await`` it to have the agent take the command, iterate it for ``{"type": ...}`` events.
    A job already finished under this id is replayed from the store, never run again."""

    def __init__(self, service: ServerService, record: SandboxRecord, request: ExecRequest, body: dict[str, Any],
                 known: Optional[Job]) -> None:
        self.service = service
        self.record = record
        self.request = request
        self.body = body
        self.known = known
        self._submitted = known is not None and known.done
        self._events: Optional[AsyncIterator[dict]] = None

    def __await__(self) -> Generator[Any, None, CommandStream]:
        return self.submit().__await__()

    async def submit(self) -> CommandStream:
        """Send the command to the agent (once); its refusal is raised here, as an error."""
        if not self._submitted:
            sandbox_id = self.record.sandbox.sandbox_id
            await self.service.forward(self.record, "POST", f"/sandboxes/{sandbox_id}/exec", json_body=self.body,
                                       timeout=30)
            self._submitted = True
            if self.known is None:  # pollable from now on, like a queued exec
                self.service.store.put_job(Job(job_id=self.body["job_id"], sandbox_id=sandbox_id,
                                               command=self.request.command_text(), status="queued",
                                               created_at=time.time()))
        return self

    def __aiter__(self) -> CommandStream:
        return self

    async def __anext__(self) -> dict:
        if self._events is None:
            self._events = self._generate()
        return await self._events.__anext__()

    async def aclose(self) -> None:
        if self._events is not None:
            await self._events.aclose()  # type: ignore[attr-defined]

    async def _generate(self) -> AsyncIterator[dict]:
        if self.known is not None and self.known.done:
            for name in ("stdout", "stderr"):
                if getattr(self.known, name):
                    yield {"type": name, "data": getattr(self.known, name)}
            yield {"type": "exit", "job": self.known.model_dump()}
            return
        await self.submit()
        service, sandbox_id = self.service, self.record.sandbox.sandbox_id
        api = await service.agent(sandbox_id)
        # The agent has the job (and its stdin) by now: this call only attaches to it by job id.
        attach = {**self.body, "stdin": None}
        async with service.exec_slots:
            async for event in api.stream(f"/sandboxes/{sandbox_id}/exec/stream", attach,
                                          timeout=self.request.effective_timeout() + 30):
                if event.get("type") == "exit":
                    service.store.put_job(Job(**event["job"]))
                yield event
