"""The Orchard Env routes, declared once: the agent and the server serve the same API.

Each serves it over an object with the methods of :class:`SandboxOperations` (results may
be plain values or awaitables); the apps add only what is theirs (health, metrics, auth).
"""

from __future__ import annotations

import inspect
import json
from typing import Any, AsyncIterator, Optional, Protocol

from fastapi import FastAPI, Header, Path, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from orchard.models import SANDBOX_ID_PATTERN, ExecRequest, FileUpload, PatchRequest, SandboxSpec, SnapshotRequest
from orchard.webapi import MAX_WAIT_SECONDS, model_response, parse_body


class SandboxOperations(Protocol):
    """What a service implements to serve the Orchard Env API (agent or server)."""

    def resources(self) -> Any: ...
    def create(self, spec: SandboxSpec) -> Any: ...
    def list(self, status: Optional[str], labels: dict[str, str]) -> Any: ...
    def get(self, sandbox_id: str) -> Any: ...
    def wait(self, sandbox_id: str, timeout: float) -> Any: ...
    def delete(self, sandbox_id: str) -> Any: ...
    def heartbeat(self, sandbox_id: str) -> Any: ...
    def exec(self, sandbox_id: str, request: ExecRequest, idempotency_key: Optional[str]) -> Any: ...
    def stream(self, sandbox_id: str, request: ExecRequest, idempotency_key: Optional[str]) -> AsyncIterator[dict]: ...
    def job(self, job_id: str) -> Any: ...
    def wait_job(self, job_id: str, timeout: float) -> Any: ...
    def apply_patch(self, sandbox_id: str, patch: PatchRequest) -> Any: ...
    def upload(self, sandbox_id: str, upload: FileUpload) -> Any: ...
    def download(self, sandbox_id: str, path: str) -> Any: ...
    def list_files(self, sandbox_id: str, path: str, offset: int, limit: Optional[int]) -> Any: ...
    def upload_raw(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes], mode: Optional[int]) -> Any: ...
    def download_raw(self, sandbox_id: str, path: str) -> Any:
        """(size or None, an async iterator of the file's bytes)."""
    def snapshot(self, sandbox_id: str, request: SnapshotRequest) -> Any: ...
    def reset(self, sandbox_id: str) -> Any: ...
    def get_snapshot(self, snapshot_id: str) -> Any: ...
    def list_snapshots(self) -> Any: ...
    def delete_snapshot(self, snapshot_id: str) -> Any: ...


def _json_body(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that reads its body itself."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_BINARY_BODY = {"requestBody": {"required": True, "content": _BINARY}}  # read as a stream, not parsed
_BINARY_RESPONSE: dict = {200: {"description": "the file's bytes", "content": _BINARY}}


# A snapshot id in a URL is checked as in a body (an id is never '..' nor holds '#' or '?',
# which would address another resource once forwarded to an agent).
_SNAPSHOT_ID = Path(pattern=SANDBOX_ID_PATTERN, description="a snapshot id")


async def _value(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def add_sandbox_routes(app: FastAPI, ops: SandboxOperations) -> None:
    @app.get("/resources")
    async def resources() -> Response:
        return model_response(await _value(ops.resources()))

    @app.post("/sandboxes")
    async def create_sandbox(spec: SandboxSpec) -> Response:
        return model_response(await _value(ops.create(spec)))

    @app.get("/sandboxes")
    async def list_sandboxes(status: Optional[str] = None,
                             label: list[str] = Query(default_factory=list, description="key=value, repeatable")) -> Response:
        labels = dict(item.split("=", 1) for item in label if "=" in item)
        found = await _value(ops.list(status, labels))
        return model_response({"sandboxes": [s.model_dump() for s in found]})

    @app.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> Response:
        return model_response(await _value(ops.get(sandbox_id)))

    @app.get("/sandboxes/{sandbox_id}/wait")
    async def wait_sandbox(sandbox_id: str, timeout: float = Query(30.0, ge=0, le=MAX_WAIT_SECONDS)) -> Response:
        return model_response(await _value(ops.wait(sandbox_id, timeout)))

    @app.delete("/sandboxes/{sandbox_id}")
    async def delete_sandbox(sandbox_id: str) -> dict:
        await _value(ops.delete(sandbox_id))
        return {"sandbox_id": sandbox_id, "deleted": True}

    @app.post("/sandboxes/{sandbox_id}/heartbeat")
    async def heartbeat(sandbox_id: str) -> Response:
        return model_response(await _value(ops.heartbeat(sandbox_id)))

    @app.post("/sandboxes/{sandbox_id}/exec", openapi_extra=_json_body(ExecRequest))
    async def exec_command(sandbox_id: str, request: Request,
                           idempotency_key: Optional[str] = Header(None)) -> Response:
        # The hot path: pydantic validates the body straight from bytes (FastAPI's body
        # handling costs ~5% of the server's CPU per command); errors read as FastAPI's.
        body = parse_body(ExecRequest, await request.body())
        return model_response(await _value(ops.exec(sandbox_id, body, idempotency_key)))

    @app.post("/sandboxes/{sandbox_id}/exec/stream")
    async def exec_stream(sandbox_id: str, body: ExecRequest,
                          idempotency_key: Optional[str] = Header(None)) -> StreamingResponse:
        """Our addition: NDJSON events, ``{"type": "stdout"|"stderr", "data"}`` then ``{"type": "exit", "job"}``."""
        # Awaited before the response starts: a refused command is an error status, not a 200
        # whose body is then cut (the server hands the command to the agent here).
        events = await _value(ops.stream(sandbox_id, body, idempotency_key))

        async def ndjson() -> AsyncIterator[bytes]:
            async for event in events:
                yield (json.dumps(event) + "\n").encode()

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")

    @app.post("/sandboxes/{sandbox_id}/apply_patch")
    async def apply_patch(sandbox_id: str, body: PatchRequest) -> Response:
        return model_response(await _value(ops.apply_patch(sandbox_id, body)))

    @app.post("/sandboxes/{sandbox_id}/files")
    async def upload_file(sandbox_id: str, body: FileUpload) -> Response:
        return model_response(await _value(ops.upload(sandbox_id, body)))

    @app.get("/sandboxes/{sandbox_id}/files")
    async def download_file(sandbox_id: str, path: str = Query(..., min_length=1)) -> Response:
        return model_response(await _value(ops.download(sandbox_id, path)))

    @app.get("/sandboxes/{sandbox_id}/files/list")
    async def list_files(sandbox_id: str, path: str = Query(".", min_length=1, max_length=4096),
                         offset: int = Query(0, ge=0, le=1 << 40),
                         limit: Optional[int] = Query(None, ge=1, description="capped by the agent's page size")
                         ) -> Response:
        """Entries sorted by name, one page at a time (``next_offset`` until it is null)."""
        return model_response(await _value(ops.list_files(sandbox_id, path, offset, limit)))

    @app.put("/sandboxes/{sandbox_id}/files/raw", openapi_extra=_BINARY_BODY)
    async def upload_raw(sandbox_id: str, request: Request, path: str = Query(..., min_length=1),
                         mode: Optional[int] = Query(None, ge=0, le=0o7777)) -> Response:
        """Our addition: upload the request body as is (large files, no base64)."""
        return model_response(await _value(ops.upload_raw(sandbox_id, path, request.stream(), mode)))

    @app.get("/sandboxes/{sandbox_id}/files/raw", response_class=Response, responses=_BINARY_RESPONSE)
    async def download_raw(sandbox_id: str, path: str = Query(..., min_length=1)) -> StreamingResponse:
        """Our addition: a file's bytes (large files, no base64)."""
        size, chunks = await _value(ops.download_raw(sandbox_id, path))
        headers = {"Content-Length": str(size)} if size is not None else None
        return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)

    @app.post("/sandboxes/{sandbox_id}/snapshot")
    async def snapshot_sandbox(sandbox_id: str, body: Optional[SnapshotRequest] = None) -> Response:
        """Our addition: freeze the sandbox's files as a snapshot that ``POST /sandboxes``
        with ``snapshot`` forks from (copy-on-write). Its processes are stopped; it goes on
        from the snapshot."""
        return model_response(await _value(ops.snapshot(sandbox_id, body or SnapshotRequest())))

    @app.post("/sandboxes/{sandbox_id}/reset")
    async def reset_sandbox(sandbox_id: str) -> Response:
        """Our addition: back to where the sandbox began (its image or snapshot), same id."""
        return model_response(await _value(ops.reset(sandbox_id)))

    @app.get("/snapshots")
    async def list_snapshots() -> Response:
        return model_response({"snapshots": [s.model_dump() for s in await _value(ops.list_snapshots())]})

    @app.get("/snapshots/{snapshot_id}")
    async def get_snapshot(snapshot_id: str = _SNAPSHOT_ID) -> Response:
        return model_response(await _value(ops.get_snapshot(snapshot_id)))

    @app.delete("/snapshots/{snapshot_id}")
    async def delete_snapshot(snapshot_id: str = _SNAPSHOT_ID) -> dict:
        """Its files stay until the last fork using them is deleted."""
        await _value(ops.delete_snapshot(snapshot_id))
        return {"snapshot_id": snapshot_id, "deleted": True}

    @app.get("/jobs/{job_id}")
    async def get_job(job_id: str) -> Response:
        return model_response(await _value(ops.job(job_id)))

    @app.get("/jobs/{job_id}/wait")
    async def wait_job(job_id: str, timeout: float = Query(30.0, ge=0, le=MAX_WAIT_SECONDS)) -> Response:
        return model_response(await _value(ops.wait_job(job_id, timeout)))
