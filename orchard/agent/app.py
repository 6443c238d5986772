"""The exec agent's HTTP app: the Orchard Env routes (:mod:`orchard.routes`, shared with
the server) over :class:`AgentService`, plus health and per-sandbox token auth. Errors
become the one error body shape; the SDK turns them back into the same exception types.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
import secrets
from typing import AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from orchard import __version__
from orchard.agent.pty_route import add_pty_route
from orchard.agent.service import AgentService
from orchard.agent.tokens import token_matches
from orchard.errors import OrchardError
from orchard.fast_exec import FastExecRoute
from orchard.routes import add_sandbox_routes
from orchard.webapi import ApiKeyMiddleware, BodyLimitMiddleware, internal_error_body, validation_body

class CallTracker:
    """Notes every request, so an agent nobody calls can tell it is idle."""

    def __init__(self, app: Callable, service: AgentService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] != "/health":
            self.service.touch()
        await self.app(scope, receive, send)


def create_app(service: AgentService, token: Optional[str]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        yield
        await service.stop()

    app = FastAPI(title="Orchard exec agent", version=__version__, lifespan=lifespan)

    def sandbox_scoped(path: str, given: str) -> bool:
        """A per-sandbox token opens that sandbox's routes and the jobs run in it; not
        snapshots, which outlive the sandbox (their owner, the server, takes them)."""
        assert token is not None
        if not path.isprintable():  # "snapshot\n" still matched the snapshot route (its regex ends in `$`)
            return False
        parts = path.split("/")
        if len(parts) >= 4 and parts[1] == "sandboxes" and parts[3] == "snapshot":
            return False
        if len(parts) >= 3 and parts[1] == "sandboxes" and parts[2]:
            sandbox_id = parts[2]
        elif len(parts) >= 3 and parts[1] == "jobs":
            record = service.jobs.get(parts[2])
            if record is None:
                return False
            sandbox_id = record.job.sandbox_id
        else:
            return False
        sandbox = service.sandboxes.get(sandbox_id)
        return sandbox is not None and token_matches(given, token, sandbox_id, sandbox.incarnation)

    app.add_middleware(FastExecRoute, ops=service, api=app)  # first: innermost, behind the others
    if token is not None:
        app.add_middleware(ApiKeyMiddleware, token=token, scoped=sandbox_scoped)
    app.add_middleware(CallTracker, service=service)
    app.add_middleware(BodyLimitMiddleware, limit=service.settings.max_body_bytes,
                       raw_limit=service.settings.max_upload_bytes)

    @app.exception_handler(OrchardError)
    async def orchard_error(request: Request, exc: OrchardError) -> JSONResponse:
        return JSONResponse(exc.to_body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(internal_error_body(exc, "agent"), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_body(exc), status_code=422)

    @app.get("/")
    async def root() -> dict:
        return {"service": "orchard-agent", "version": __version__}

    @app.get("/health")
    async def health() -> dict:
        """Liveness only: it needs no key, so it tells nothing (counts are in /resources)."""
        return {"status": "ok"}

    def ws_authorized(given: Optional[str], sandbox_id: str) -> bool:
        """The WebSocket route checks its own key (the middleware sees only HTTP)."""
        if token is None:
            return True
        if not given:
            return False
        return secrets.compare_digest(given.encode(), token.encode()) or sandbox_scoped(
            f"/sandboxes/{sandbox_id}/exec/pty", given)

    add_sandbox_routes(app, service)
    add_pty_route(app, service, ws_authorized)
    return app
