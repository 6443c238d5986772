"""The Orchard Env REST API served by ``orchard serve`` (the wire contract of DESIGN.md).

The routes are :mod:`orchard.routes`, shared with the agent; this app adds the server's
own: health, metrics, request logging, auth, and the reconciler's life cycle.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchard import __version__
from orchard.errors import OrchardError
from orchard.fast_exec import FastExecRoute
from orchard.routes import add_sandbox_routes
from orchard.server.observability import Metrics, RequestLogMiddleware
from orchard.server.pty_relay import add_pty_relay
from orchard.server.reconciler import Reconciler
from orchard.server.service import ServerService
from orchard.webapi import ApiKeyMiddleware, BodyLimitMiddleware, internal_error_body, validation_body

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
    app.add_middleware(FastExecRoute, ops=service, api=app)  # first: innermost, behind the others
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, token=api_key)
    app.add_middleware(BodyLimitMiddleware, limit=service.config.max_body_bytes,
                       raw_limit=service.config.max_upload_bytes)
    app.add_middleware(RequestLogMiddleware, metrics=metrics)

    @app.exception_handler(OrchardError)
    async def orchard_error(request: Request, exc: OrchardError) -> JSONResponse:
        metrics.errors.labels(type(exc).__name__).inc()
        return JSONResponse(exc.to_body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        metrics.errors.labels("InternalError").inc()
        return JSONResponse(internal_error_body(exc, "server"), status_code=500)

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

    add_sandbox_routes(app, service)
    add_pty_relay(app, service, api_key)
    return app
