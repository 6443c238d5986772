"""The exec agent's HTTP app: the sandbox-scoped routes of the Orchard Env API.

Each route delegates to :class:`AgentService` in a line or two; errors become the
one error body shape, and the SDK turns them back into the same exception types.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from orchard import __version__
from orchard.agent.service import AgentService
from orchard.agent.tokens import token_matches
from orchard.errors import OrchardError
from orchard.models import ExecRequest, FileUpload, PatchRequest, SandboxSpec
from orchard.webapi import MAX_WAIT_SECONDS, ApiKeyMiddleware, model_response, validation_body

def create_app(service: AgentService, token: Optional[str]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        yield
        await service.stop()

    app = FastAPI(title="Orchard exec agent", version=__version__, lifespan=lifespan)

    def sandbox_scoped(path: str, given: str) -> bool:
        """A per-sandbox token opens that sandbox's routes and the jobs run in it."""
        assert token is not None
        parts = path.split("/")
        if len(parts) >= 3 and parts[1] == "sandboxes" and parts[2]:
            return token_matches(given, token, parts[2])
        if len(parts) >= 3 and parts[1] == "jobs":
            record = service.jobs.get(parts[2])
            return record is not None and token_matches(given, token, record.job.sandbox_id)
        return False

    if token is not None:
        app.add_middleware(ApiKeyMiddleware, token=token, scoped=sandbox_scoped)

    @app.exception_handler(OrchardError)
    async def orchard_error(request: Request, exc: OrchardError) -> JSONResponse:
        return JSONResponse(exc.to_body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_body(exc), status_code=422)

    @app.get("/")
    async def root() -> dict:
        return {"service": "orchard-agent", "version": __version__}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "runtime": service.settings.runtime, "sandboxes": len(service.sandboxes)}

    @app.get("/resources")
    async def resources() -> dict:
        return service.resources()

    @app.post("/sandboxes")
    async def create_sandbox(spec: SandboxSpec) -> Response:
        return model_response(await service.create(spec))

    @app.get("/sandboxes")
    async def list_sandboxes() -> Response:
        return model_response({"sandboxes": [s.model_dump() for s in service.list()]})

    @app.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> Response:
        return model_response(service.get(sandbox_id))

    @app.get("/sandboxes/{sandbox_id}/wait")
    async def wait_sandbox(sandbox_id: str, timeout: float = Query(30.0, ge=0, le=MAX_WAIT_SECONDS)) -> Response:
        return model_response(await service.wait(sandbox_id, timeout))

    @app.delete("/sandboxes/{sandbox_id}")
    async def delete_sandbox(sandbox_id: str) -> dict:
        await service.delete(sandbox_id)
        return {"sandbox_id": sandbox_id, "deleted": True}

    @app.post("/sandboxes/{sandbox_id}/heartbeat")
    async def heartbeat(sandbox_id: str) -> Response:
        return model_response(service.heartbeat(sandbox_id))

    @app.post("/sandboxes/{sandbox_id}/exec")
    async def exec_command(sandbox_id: str, body: ExecRequest,
                           idempotency_key: Optional[str] = Header(None)) -> Response:
        return model_response(await service.exec(sandbox_id, body, idempotency_key))

    @app.post("/sandboxes/{sandbox_id}/exec/stream")
    async def exec_stream(sandbox_id: str, body: ExecRequest,
                          idempotency_key: Optional[str] = Header(None)) -> StreamingResponse:
        events = service.stream(sandbox_id, body, idempotency_key)

        async def ndjson() -> AsyncIterator[bytes]:
            async for event in events:
                yield (json.dumps(event) + "\n").encode()

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")

    @app.post("/sandboxes/{sandbox_id}/apply_patch")
    async def apply_patch(sandbox_id: str, body: PatchRequest) -> Response:
        return model_response(await service.apply_patch(sandbox_id, body))

    @app.post("/sandboxes/{sandbox_id}/files")
    async def upload_file(sandbox_id: str, body: FileUpload) -> Response:
        return model_response(service.upload(sandbox_id, body))

    @app.get("/sandboxes/{sandbox_id}/files")
    async def download_file(sandbox_id: str, path: str = Query(..., min_length=1)) -> Response:
        return model_response(service.download(sandbox_id, path))

    @app.put("/sandboxes/{sandbox_id}/files/raw")
    async def upload_raw(sandbox_id: str, request: Request, path: str = Query(..., min_length=1),
                         mode: Optional[int] = Query(None, ge=0, le=0o7777)) -> Response:
        """Our addition: upload the request body as is (large files, no base64)."""
        return model_response(await service.upload_stream(sandbox_id, path, request.stream(), mode))

    @app.get("/sandboxes/{sandbox_id}/files/raw")
    async def download_raw(sandbox_id: str, path: str = Query(..., min_length=1)) -> StreamingResponse:
        """Our addition: stream a file's bytes (large files, no base64)."""
        size, chunks = service.download_stream(sandbox_id, path)
        return StreamingResponse(chunks, media_type="application/octet-stream",
                                 headers={"Content-Length": str(size)})

    @app.get("/sandboxes/{sandbox_id}/files/list")
    async def list_files(sandbox_id: str, path: str = Query(".", min_length=1)) -> Response:
        return model_response(service.list_files(sandbox_id, path))

    @app.get("/jobs/{job_id}")
    async def get_job(job_id: str) -> Response:
        return model_response(service.job(job_id))

    @app.get("/jobs/{job_id}/wait")
    async def wait_job(job_id: str, timeout: float = Query(30.0, ge=0, le=MAX_WAIT_SECONDS)) -> Response:
        return model_response(await service.wait_job(job_id, timeout))

    return app
