"""The Orchard Env REST API served by ``orchard serve`` (the wire contract of DESIGN.md).

Routes delegate to :class:`ServerService`; error bodies, validation and auth work as in
the agent, so both speak exactly the same API.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchard import __version__
from orchard.errors import OrchardError
from orchard.models import ExecRequest, FileUpload, PatchRequest, SandboxSpec
from orchard.server.observability import Metrics, RequestLogMiddleware
from orchard.server.reconciler import Reconciler
from orchard.server.service import ServerService
from orchard.webapi import MAX_WAIT_SECONDS, ApiKeyMiddleware, model_response, validation_body



def create_app(service: ServerService, reconciler: Reconciler, api_key: Optional[str]) -> FastAPI:
    metrics: Metrics = service.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reconciler.start()
        yield
        await reconciler.stop()
        await service.close()

    app = FastAPI(title="Orchard Env", version=__version__, lifespan=lifespan,
                  description="Sandboxes for training language-model agents (compatible with the original Orchard Env).")
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, token=api_key)
    app.add_middleware(RequestLogMiddleware, metrics=metrics)

    @app.exception_handler(OrchardError)
    async def orchard_error(request: Request, exc: OrchardError) -> JSONResponse:
        metrics.errors.labels(type(exc).__name__).inc()
        return JSONResponse(exc.to_body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.errors.labels("InvalidRequest").inc()
        return JSONResponse(validation_body(exc), status_code=422)

    @app.get("/")
    async def root() -> dict:
        return {"service": "orchard-env", "version": __version__, "backend": service.backend.name}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "backend": service.backend.name}

    @app.get("/metrics")
    async def prometheus() -> Response:
        counts: dict[str, int] = {}
        for record in service.store.list_sandboxes():
            counts[record.sandbox.status] = counts.get(record.sandbox.status, 0) + 1
        for status in ("pending", "ready", "failed", "lost"):
            metrics.sandboxes.labels(status).set(counts.get(status, 0))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/resources")
    async def resources() -> dict:
        return await service.resources()

    @app.post("/sandboxes")
    async def create_sandbox(spec: SandboxSpec) -> Response:
        return model_response(await service.create(spec))

    @app.get("/sandboxes")
    async def list_sandboxes(status: Optional[str] = None,
                             label: list[str] = Query(default_factory=list, description="key=value, repeatable")) -> Response:
        labels = dict(item.split("=", 1) for item in label if "=" in item)
        return model_response({"sandboxes": [s.model_dump() for s in service.list(status, labels)]})

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
        return model_response(service.get(sandbox_id))

    @app.post("/sandboxes/{sandbox_id}/exec")
    async def exec_command(sandbox_id: str, body: ExecRequest,
                           idempotency_key: Optional[str] = Header(None)) -> Response:
        answer = await service.exec(sandbox_id, body, idempotency_key)
        return Response(answer, media_type="application/json")

    @app.post("/sandboxes/{sandbox_id}/exec/stream")
    async def exec_stream(sandbox_id: str, body: ExecRequest) -> StreamingResponse:
        events = service.stream(sandbox_id, body)

        async def ndjson() -> AsyncIterator[bytes]:
            async for event in events:
                yield (json.dumps(event) + "\n").encode()

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")

    @app.get("/jobs/{job_id}")
    async def get_job(job_id: str) -> Response:
        return model_response(await service.job(job_id))

    @app.get("/jobs/{job_id}/wait")
    async def wait_job(job_id: str, timeout: float = Query(30.0, ge=0, le=MAX_WAIT_SECONDS)) -> Response:
        return model_response(await service.job(job_id, wait=timeout))

    @app.post("/sandboxes/{sandbox_id}/apply_patch")
    async def apply_patch(sandbox_id: str, body: PatchRequest) -> dict:
        return await service.files(sandbox_id, "POST", "apply_patch", json_body=body.model_dump(),
                                   timeout=(body.timeout_seconds or 60) + 30)

    @app.post("/sandboxes/{sandbox_id}/files")
    async def upload_file(sandbox_id: str, body: FileUpload) -> dict:
        return await service.files(sandbox_id, "POST", "files", json_body=body.model_dump())

    @app.get("/sandboxes/{sandbox_id}/files")
    async def download_file(sandbox_id: str, path: str = Query(..., min_length=1)) -> dict:
        return await service.files(sandbox_id, "GET", "files", params={"path": path})

    @app.get("/sandboxes/{sandbox_id}/files/list")
    async def list_files(sandbox_id: str, path: str = Query(".", min_length=1)) -> dict:
        return await service.files(sandbox_id, "GET", "files/list", params={"path": path})

    @app.put("/sandboxes/{sandbox_id}/files/raw")
    async def upload_raw(sandbox_id: str, request: Request, path: str = Query(..., min_length=1),
                         mode: Optional[int] = Query(None, ge=0, le=0o7777)) -> dict:
        params = {"path": path, **({"mode": mode} if mode is not None else {})}
        return await service.files(sandbox_id, "PUT", "files/raw", params=params, content=await request.body(),
                                   timeout=600)

    @app.get("/sandboxes/{sandbox_id}/files/raw")
    async def download_raw(sandbox_id: str, path: str = Query(..., min_length=1)) -> Response:
        data = await service.files(sandbox_id, "GET", "files/raw", params={"path": path}, raw_response=True,
                                   timeout=600)
        return Response(data, media_type="application/octet-stream")

    return app
