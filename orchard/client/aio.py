"""The async Python SDK: ``AsyncClient`` and ``AsyncSandbox``.

With a ``url`` it talks to an Orchard Env server (or an agent) over HTTP; without one
it runs a backend in process (``local`` by default), with no server at all. Either
way exec and file calls go straight to the sandbox's agent.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from typing import Any, AsyncIterator, Optional, Union

from orchard.backends.api import Backend
from orchard.backends.loading import load_backend  # noqa: F401  (re-exported)
from orchard.client.http import ApiClient, ScopedApi
from orchard.client.pty import AsyncPty
from orchard.client.session import AsyncShellSession
from orchard.errors import AnswerTooLarge, CommandFailed, ExecTimeout, PayloadTooLarge, SandboxLost
from orchard.models import FileEntry, Job, PatchResult, Sandbox, SandboxSpec, Snapshot, SnapshotRequest

Command = Union[str, list[str]]
HTTP_MARGIN = 30.0
DOWNLOAD_LIMIT = 1 << 30  # bytes a download reads into memory unless told otherwise
RAW_UPLOAD_THRESHOLD = 1 << 20


def _raise_for(job: Job) -> Job:
    if job.error_type == "sandbox_lost":
        raise SandboxLost(job.error or "sandbox lost")
    if job.error_type == "timeout":
        raise ExecTimeout(f"{job.error}: {job.command!r}")
    if job.exit_code != 0 or job.error_type is not None:
        raise CommandFailed(f"exit code {job.exit_code} from {job.command!r}: {job.stderr[-2000:] or job.error}")
    return job


class GoneAgent:
    """Stands in for the agent of a sandbox lost together with it: every call raises why."""

    def __init__(self, error: SandboxLost) -> None:
        self.error = error

    async def request(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[dict]:
        raise self.error
        yield {}  # pragma: no cover - makes this an async generator

    async def websocket(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


class AsyncSandbox:
    """A handle on one sandbox. ``async with`` deletes it on the way out, whatever happens."""

    def __init__(self, client: "AsyncClient", info: Sandbox, api: Union[ApiClient, ScopedApi, GoneAgent]) -> None:
        self.client = client
        self.info = info
        self.api = api
        self._heartbeat_task: Optional[asyncio.Task] = None

    @property
    def id(self) -> str:
        return self.info.sandbox_id

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.status} image={self.info.image!r}>"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.delete()

    def _exec_body(self, command: Command, *, timeout: Optional[float], idle_timeout: Optional[float],
                   cwd: Optional[str], env: Optional[dict[str, str]], login_shell: bool, stdin: Optional[str],
                   job_id: Optional[str], wait: bool) -> dict:
        return {"command": command, "timeout_seconds": timeout, "idle_timeout_seconds": idle_timeout, "cwd": cwd,
                "env": env or {}, "login_shell": login_shell, "stdin": stdin, "wait": wait,
                "job_id": job_id or f"job-{secrets.token_hex(8)}"}  # a client-chosen id makes retries safe

    async def exec(self, command: Command, *, timeout: Optional[float] = None, idle_timeout: Optional[float] = None,
                   cwd: Optional[str] = None, env: Optional[dict[str, str]] = None, login_shell: bool = False,
                   stdin: Optional[str] = None, job_id: Optional[str] = None, check: bool = False,
                   pty: bool = False) -> Any:
        """Run a command and return its job record (``check=True`` raises on failure); with
        ``pty=True``, start it on a terminal and return its :class:`AsyncPty` handle."""
        if pty:
            argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
            return await self.pty(argv, env=env, cwd=cwd, login_shell=login_shell)
        body = self._exec_body(command, timeout=timeout, idle_timeout=idle_timeout, cwd=cwd, env=env,
                               login_shell=login_shell, stdin=stdin, job_id=job_id, wait=True)
        http_timeout = (timeout or 300.0) + HTTP_MARGIN
        job = Job(**await self.api.request("POST", f"/sandboxes/{self.id}/exec", json_body=body, timeout=http_timeout))
        return _raise_for(job) if check else job

    async def submit(self, command: Command, *, timeout: Optional[float] = None,
                     idle_timeout: Optional[float] = None, cwd: Optional[str] = None,
                     env: Optional[dict[str, str]] = None, login_shell: bool = False, stdin: Optional[str] = None,
                     job_id: Optional[str] = None) -> str:
        """Start a command without waiting; returns its job id (poll with :meth:`wait_job`)."""
        body = self._exec_body(command, timeout=timeout, idle_timeout=idle_timeout, cwd=cwd, env=env,
                               login_shell=login_shell, stdin=stdin, job_id=job_id, wait=False)
        return (await self.api.request("POST", f"/sandboxes/{self.id}/exec", json_body=body))["job_id"]

    async def pty(self, cmd: Optional[list[str]] = None, *, env: Optional[dict[str, str]] = None,
                  cwd: Optional[str] = None, rows: int = 24, cols: int = 80, login_shell: bool = False,
                  attach: Optional[str] = None) -> AsyncPty:
        """An interactive process on a terminal (default: the sandbox's shell); ``attach``
        reattaches to one whose connection dropped (its ``session_id``)."""
        return await AsyncPty.open(self.api, self.id, cmd, env=env, cwd=cwd, rows=rows, cols=cols,
                                   login_shell=login_shell, attach=attach)

    async def session(self, *, env: Optional[dict[str, str]] = None, cwd: Optional[str] = None,
                      max_output_bytes: int = 1 << 20, timeout: float = 30.0) -> AsyncShellSession:
        """A persistent bash: ``await session.run("cd src && make")``; state persists.
        ``timeout``: seconds for the shell to come up."""
        return await AsyncShellSession.start(self, env=env, cwd=cwd, max_output_bytes=max_output_bytes,
                                             timeout=timeout)

    async def job(self, job_id: str) -> Job:
        return Job(**await self.api.request("GET", f"/jobs/{job_id}"))

    async def wait_job(self, job_id: str, timeout: float = 30.0) -> Job:
        return Job(**await self.api.request("GET", f"/jobs/{job_id}/wait", params={"timeout": timeout},
                                            timeout=timeout + HTTP_MARGIN))

    async def exec_stream(self, command: Command, *, timeout: Optional[float] = None,
                          idle_timeout: Optional[float] = None, cwd: Optional[str] = None,
                          env: Optional[dict[str, str]] = None, login_shell: bool = False,
                          stdin: Optional[str] = None) -> AsyncIterator[dict]:
        """Yield ``{"type": "stdout"|"stderr", "data": ...}`` as output comes, then ``{"type": "exit", "job": ...}``."""
        body = self._exec_body(command, timeout=timeout, idle_timeout=idle_timeout, cwd=cwd, env=env,
                               login_shell=login_shell, stdin=stdin, job_id=None, wait=False)
        async for event in self.api.stream(f"/sandboxes/{self.id}/exec/stream", body,
                                           timeout=(timeout or 300.0) + HTTP_MARGIN):
            yield event

    async def upload(self, path: str, data: Union[bytes, str], mode: Optional[int] = None) -> int:
        """Write a file; large ones go as raw bytes (``PUT .../files/raw``), small ones as the
        original API's base64 JSON."""
        raw = data.encode() if isinstance(data, str) else data
        if len(raw) > RAW_UPLOAD_THRESHOLD:
            params: dict[str, Any] = {"path": path, **({"mode": mode} if mode is not None else {})}
            body = await self.api.request("PUT", f"/sandboxes/{self.id}/files/raw", params=params, content=raw,
                                          timeout=HTTP_MARGIN + len(raw) / 10e6)
            return body["size"]
        body = {"path": path, "content": base64.b64encode(raw).decode(), "mode": mode}
        return (await self.api.request("POST", f"/sandboxes/{self.id}/files", json_body=body))["size"]

    async def download(self, path: str, max_bytes: Optional[int] = DOWNLOAD_LIMIT) -> bytes:
        """A file's bytes, streamed raw (``GET .../files/raw``), at most ``max_bytes`` of them
        (None: no limit): a file the sandbox made (a sparse terabyte costs it one ``truncate``)
        must not fill the caller's memory. Larger: PayloadTooLarge, nothing kept."""
        try:
            return await self.api.request("GET", f"/sandboxes/{self.id}/files/raw", params={"path": path},
                                          raw_response=True, timeout=HTTP_MARGIN * 10, answer_cap=max_bytes)
        except AnswerTooLarge:
            raise PayloadTooLarge(f"{path} is larger than max_bytes={max_bytes}; pass a larger max_bytes "
                                  f"(or None) to read it") from None

    async def list_files(self, path: str = ".") -> list[FileEntry]:
        """Every entry of a directory, sorted by name (fetched page by page)."""
        entries: list[FileEntry] = []
        offset: Optional[int] = 0
        while offset is not None:
            body = await self.api.request("GET", f"/sandboxes/{self.id}/files/list",
                                          params={"path": path, "offset": offset})
            entries += [FileEntry(**entry) for entry in body["files"]]
            following = body.get("next_offset")
            offset = following if isinstance(following, int) and following > offset else None
        return entries

    async def apply_patch(self, patch: str, timeout: Optional[float] = None) -> PatchResult:
        body = {"patch": patch, "timeout_seconds": timeout}
        return PatchResult(**await self.api.request("POST", f"/sandboxes/{self.id}/apply_patch", json_body=body))

    async def heartbeat(self) -> Sandbox:
        self.info = Sandbox(**await self.client.control_request("POST", f"/sandboxes/{self.id}/heartbeat"))
        return self.info

    def start_heartbeats(self, interval: float = 30.0) -> None:
        """Keep the sandbox alive from the background until it is deleted."""
        async def beat() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.heartbeat()
                except SandboxLost:
                    return
                except Exception:
                    continue
        if self._heartbeat_task is None:
            self._heartbeat_task = asyncio.get_running_loop().create_task(beat())

    async def refresh(self) -> Sandbox:
        self.info = await self.client.status(self.id)
        return self.info

    async def snapshot(self, snapshot_id: Optional[str] = None) -> Snapshot:
        """Freeze this sandbox's files; :meth:`AsyncClient.fork` starts sandboxes from them.
        Processes running in it are stopped (it goes on from the snapshot, files intact)."""
        return await self.client.snapshot(self.id, snapshot_id)

    async def reset(self) -> Sandbox:
        """Back to where this sandbox began (its image, or the snapshot it was forked from)."""
        if self.client._remote is not None:
            self.info = Sandbox(**await self.client._remote.request("POST", f"/sandboxes/{self.id}/reset",
                                                                    timeout=300 + HTTP_MARGIN))
        else:
            self.info = await self.client.backend.reset(self.id)
        return self.info

    async def delete(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            self._heartbeat_task = None
        await self.client.delete(self.id)


class AsyncClient:
    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, *,
                 backend: Union[str, Backend, None] = None, backend_settings: Optional[dict[str, Any]] = None,
                 timeout: float = 60.0, retries: int = 5, direct: bool = False,
                 heartbeat_interval: float = 30.0, ca_file: Optional[str] = None) -> None:
        """``direct=True`` (with a server ``url``): exec and file calls of sandboxes this
        client creates go straight to their agent with a token for that sandbox alone, and
        heartbeats are sent to the server in the background, since it no longer sees the calls.
        ``ca_file`` (an https ``url``): trust only certificates it vouches for, so nothing but
        the server holding that certificate's key ever gets the API key."""
        self.url = url
        self.direct = direct and url is not None
        self.heartbeat_interval = heartbeat_interval
        self._timeout, self._retries = timeout, retries
        self._remote = ApiClient(url, api_key, timeout=timeout, retries=retries, ca_file=ca_file) if url else None
        if self._remote is None:
            self._owns_backend = not isinstance(backend, Backend)  # built here: shut down here too
            self.backend = backend if isinstance(backend, Backend) else load_backend(backend or "local", backend_settings)
        self._agents: dict[str, ApiClient] = {}

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for api in [self._remote, *self._agents.values()]:
            if api is not None:
                await api.close()
        if self._remote is None:
            if self._owns_backend:
                await self.backend.shutdown()
            await self.backend.close()

    async def _agent_for(self, sandbox_id: str) -> ApiClient:
        if self._remote is not None:
            return self._remote
        endpoint = await self.backend.endpoint(sandbox_id)
        return self._agent_at(endpoint.url, endpoint.token)

    def _agent_at(self, url: str, token: Optional[str] = None) -> ApiClient:
        """One client per agent, known by address *and* key: an address is reused when a
        per-job sandbox's relay or a pod's IP goes to a new agent, whose key differs."""
        key = f"{url} {token}"
        api = self._agents.get(key)
        if api is None:
            api = self._agents[key] = ApiClient(url, token, timeout=self._timeout, retries=self._retries)
        return api

    async def control_request(self, method: str, path: str, **kwargs: Any) -> Any:
        """A life-cycle call: to the server, or (in process) to the sandbox's agent."""
        if self._remote is not None:
            return await self._remote.request(method, path, **kwargs)
        sandbox_id = path.split("/")[2]
        return await (await self._agent_for(sandbox_id)).request(method, path, **kwargs)

    async def create(self, image: str = "host", **spec: Any) -> AsyncSandbox:
        """Create a sandbox and wait until it is ready (``async with`` it to clean up)."""
        # The id is chosen here, so a create retried after a dropped connection finds the
        # sandbox its first attempt made instead of making a second one.
        model = SandboxSpec(image=image, **{"sandbox_id": f"sbx-{secrets.token_hex(6)}", **spec})
        if self._remote is not None:
            info = Sandbox(**await self._remote.request("POST", "/sandboxes", json_body=model.model_dump(),
                                                        timeout=(model.timeout or 300) + HTTP_MARGIN))
        else:
            info = await self.backend.create(model)
        if self.direct and info.agent_url and info.agent_token:
            handle = AsyncSandbox(self, info, ScopedApi(self._agent_at(info.agent_url), info.agent_token))
            handle.start_heartbeats(self.heartbeat_interval)
            return handle
        return AsyncSandbox(self, info, await self._agent_for(info.sandbox_id))

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        info = await self.status(sandbox_id)
        try:
            api: Union[ApiClient, ScopedApi, GoneAgent] = await self._agent_for(sandbox_id)
        except SandboxLost as exc:  # lost with its agent (a Slurm pilot that ended): the handle still reads
            api = GoneAgent(exc)
        return AsyncSandbox(self, info, api)

    async def snapshot(self, sandbox_id: str, snapshot_id: Optional[str] = None) -> Snapshot:
        # The id is chosen here, like a sandbox's, so a retried call takes one snapshot.
        request = SnapshotRequest(snapshot_id=snapshot_id or f"snap-{secrets.token_hex(6)}")
        if self._remote is not None:
            return Snapshot(**await self._remote.request("POST", f"/sandboxes/{sandbox_id}/snapshot",
                                                         json_body=request.model_dump(), timeout=300 + HTTP_MARGIN))
        return await self.backend.snapshot(sandbox_id, request)

    async def fork(self, snapshot: Union[Snapshot, str], n: int = 1, **spec: Any) -> list[AsyncSandbox]:
        """``n`` sandboxes started from ``snapshot`` (copy-on-write: no setup, no copy), made
        concurrently; all or none (those made are deleted if one fails)."""
        if n < 1:
            raise ValueError("n must be at least 1")
        if isinstance(snapshot, str):
            snapshot = await self.get_snapshot(snapshot)
        results = await asyncio.gather(*(self.create(snapshot.image, snapshot=snapshot.snapshot_id, **spec)
                                         for _ in range(n)), return_exceptions=True)
        made = [r for r in results if isinstance(r, AsyncSandbox)]
        failed = [r for r in results if not isinstance(r, AsyncSandbox)]
        if failed:
            await asyncio.gather(*(sandbox.delete() for sandbox in made), return_exceptions=True)
            raise failed[0]
        return made

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        if self._remote is not None:
            return Snapshot(**await self._remote.request("GET", f"/snapshots/{snapshot_id}"))
        return await self.backend.get_snapshot(snapshot_id)

    async def list_snapshots(self) -> list[Snapshot]:
        if self._remote is not None:
            return [Snapshot(**item) for item in (await self._remote.request("GET", "/snapshots"))["snapshots"]]
        return await self.backend.list_snapshots()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Its files go once the last fork using them is deleted."""
        if self._remote is not None:
            await self._remote.request("DELETE", f"/snapshots/{snapshot_id}")
        else:
            await self.backend.delete_snapshot(snapshot_id)

    async def status(self, sandbox_id: str) -> Sandbox:
        if self._remote is not None:
            return Sandbox(**await self._remote.request("GET", f"/sandboxes/{sandbox_id}"))
        return await self.backend.status(sandbox_id)

    async def list(self) -> list[Sandbox]:
        if self._remote is not None:
            return [Sandbox(**item) for item in (await self._remote.request("GET", "/sandboxes"))["sandboxes"]]
        return await self.backend.list()

    async def delete(self, sandbox_id: str) -> None:
        if self._remote is not None:
            await self._remote.request("DELETE", f"/sandboxes/{sandbox_id}")
        else:
            await self.backend.delete(sandbox_id)

    async def resources(self) -> dict:
        if self._remote is not None:
            return await self._remote.request("GET", "/resources")
        return await self.backend.resources()
