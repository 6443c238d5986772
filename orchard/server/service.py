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
from typing import Any, AsyncIterator, Optional

from orchard.agent.tokens import sandbox_token
from orchard.backends.api import Backend
from orchard.client.http import ApiClient
from orchard.errors import (
    AgentUnreachable, JobNotFound, OrchardError, SandboxConflict, SandboxLost, SandboxNotFound, SandboxNotReady,
    WaitTimeout,
)
from orchard.models import ExecRequest, FileUpload, Job, PatchRequest, QueuedJob, Sandbox, SandboxSpec
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

    async def close(self) -> None:
        self.flush_heartbeats()
        for api in self._agents.values():
            await api.close()
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
        self._last_seen[sandbox_id] = time.time()

    def flush_heartbeats(self) -> None:
        seen, self._last_seen = self._last_seen, {}
        self.store.touch_many(seen)

    def mark_lost(self, record: SandboxRecord, reason: str) -> None:
        if record.sandbox.status == "lost":
            return
        record.sandbox = record.sandbox.model_copy(update={"status": "lost", "ready": False, "status_message": reason})
        self.store.put_sandbox(record)
        for job in self.store.unfinished_jobs(record.sandbox.sandbox_id):
            self.store.put_job(job.model_copy(update={
                "status": "failed", "error_type": "sandbox_lost", "error": f"sandbox lost: {reason}",
                "completed_at": time.time()}))
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
        sandbox_id = spec.sandbox_id or f"sbx-{secrets.token_hex(6)}"
        existing = self.store.get_sandbox(sandbox_id)
        if existing is not None:
            if existing.spec.identity() != spec.identity():
                raise SandboxConflict(f"sandbox {sandbox_id!r} already exists with a different spec")
            if sandbox_id in self._creating:
                await self._creating[sandbox_id].wait()
            return self.record(sandbox_id).sandbox
        spec = spec.model_copy(update={"sandbox_id": sandbox_id})
        now = time.time()
        pending = Sandbox(sandbox_id=sandbox_id, image=spec.image, status="pending", block_network=spec.block_network,
                          cpu=spec.cpu, memory=spec.memory, disk=spec.disk, pids=spec.pids, labels=spec.labels,
                          backend=self.backend.name, created_at=now)
        self.store.put_sandbox(SandboxRecord(spec, pending, now))
        self._creating[sandbox_id] = asyncio.Event()
        start = time.perf_counter()
        owned = spec.model_copy(update={"labels": {**spec.labels, OWNER_LABEL: self.server_id}})
        try:
            created = await self.backend.create(owned)
        except BaseException:
            self.store.remove_sandbox(sandbox_id)
            raise
        finally:
            self._creating.pop(sandbox_id).set()
        self.metrics.create_seconds.observe(time.perf_counter() - start)
        sandbox = created.model_copy(update={"labels": spec.labels, "backend": self.backend.name,
                                             "agent_url": None, "agent_token": None})
        self.store.put_sandbox(SandboxRecord(spec, sandbox, time.time()))
        emit_event({"type": "ready", "sandbox_id": sandbox_id, "time": time.time()})
        endpoint = await self.backend.endpoint(sandbox_id)
        if endpoint.token is None:
            return sandbox
        # Only the creator hears of the direct path; GET never shows the token again.
        return sandbox.model_copy(update={"agent_url": endpoint.url,
                                          "agent_token": sandbox_token(endpoint.token, sandbox_id)})

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

    async def delete(self, sandbox_id: str, reason: str = "deleted") -> None:
        record = self.record(sandbox_id)
        if record.sandbox.status != "lost":
            try:
                await self.backend.delete(sandbox_id)
            except SandboxNotFound:
                pass
        self.store.remove_sandbox(sandbox_id)
        self._last_seen.pop(sandbox_id, None)
        emit_event({"type": "deleted", "sandbox_id": sandbox_id, "time": time.time(), "reason": reason})

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
    async def exec(self, sandbox_id: str, request: ExecRequest, idempotency_key: Optional[str]) -> bytes:
        """Run a command through the sandbox's agent; returns the agent's JSON answer as is."""
        record = self.usable(sandbox_id)
        key = request.job_id or idempotency_key
        if key is not None:
            known = self.store.get_job(key)
            if known is not None and (known.sandbox_id != sandbox_id or known.command != request.command_text()):
                raise SandboxConflict(f"job id {key!r} was already used for a different command")
            if known is not None and known.done:
                answer = known if request.wait else QueuedJob(job_id=key, status=known.status)
                return answer.model_dump_json().encode()
        job_id = key or f"job-{secrets.token_hex(8)}"
        if not request.wait:  # a job polled later must be findable even if this server restarts first
            self.store.put_job(Job(job_id=job_id, sandbox_id=sandbox_id, command=request.command_text(),
                                   status="queued", created_at=time.time()))
        body = request.model_dump(mode="json")
        body["job_id"] = job_id  # the agent is idempotent on it: a retry never runs twice
        start = time.perf_counter()
        async with self.exec_slots:
            answer = await self.forward(record, "POST", f"/sandboxes/{sandbox_id}/exec", json_body=body,
                                        timeout=request.effective_timeout() + 30, raw_response=True)
        if request.wait:
            self.metrics.exec_seconds.observe(time.perf_counter() - start)
            self.store.put_job_json(sandbox_id, answer)
        return answer

    async def stream(self, sandbox_id: str, request: ExecRequest,
                     idempotency_key: Optional[str] = None) -> AsyncIterator[dict]:
        self.usable(sandbox_id)
        body = request.model_dump(mode="json")
        body["job_id"] = body.get("job_id") or idempotency_key or f"job-{secrets.token_hex(8)}"
        api = await self.agent(sandbox_id)
        async with self.exec_slots:
            async for event in api.stream(f"/sandboxes/{sandbox_id}/exec/stream", body,
                                          timeout=request.effective_timeout() + 30):
                if event.get("type") == "exit":
                    self.store.put_job(Job(**event["job"]))
                yield event

    async def wait_job(self, job_id: str, timeout: float) -> Job:
        return await self.job(job_id, wait=timeout)

    async def job(self, job_id: str, wait: Optional[float] = None) -> Job:
        """A job from the store, brought up to date from its agent while it is not done."""
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
            await self.confirm_lost(record)
            return self.store.get_job(job_id) or job
        except SandboxLost:
            return self.store.get_job(job_id) or job
        self.store.put_job(fresh)
        return fresh

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
        data = b"".join([chunk async for chunk in chunks])
        return await self._files(sandbox_id, "PUT", "files/raw", params={"path": path, "mode": mode}, content=data,
                                 timeout=600)

    async def download_raw(self, sandbox_id: str, path: str) -> tuple[int, AsyncIterator[bytes]]:
        data = await self._files(sandbox_id, "GET", "files/raw", params={"path": path}, raw_response=True,
                                 timeout=600)

        async def chunks() -> AsyncIterator[bytes]:
            yield data

        return len(data), chunks()

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
