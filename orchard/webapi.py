"""HTTP pieces shared by the agent and the server: auth, the error body, fast responses."""

from __future__ import annotations

import json
import secrets
from typing import Any, Callable, Optional, TypeVar

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from orchard.errors import AuthenticationFailed, PayloadTooLarge

OPEN_PATHS = {"/", "/health"}
MAX_WAIT_SECONDS = 3600.0


def json_body(model: BaseModel | list[BaseModel] | dict | bytes) -> str | bytes:
    """Serialize with pydantic directly: FastAPI's generic encoder costs ~0.3 ms a call.
    ``bytes`` are JSON already (an agent's answer the server passes on)."""
    if isinstance(model, bytes):
        return model
    if isinstance(model, BaseModel):
        return model.model_dump_json()
    if isinstance(model, list):
        return "[" + ",".join(m.model_dump_json() for m in model) + "]"
    return json.dumps(model)


def model_response(model: BaseModel | list[BaseModel] | dict | bytes, status_code: int = 200) -> Response:
    return Response(content=json_body(model), status_code=status_code, media_type="application/json")


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_body(model: type[ModelT], raw: bytes) -> ModelT:
    """Validate a JSON body; errors are FastAPI's (422, locations under ``body``)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def validation_body(exc: RequestValidationError) -> dict[str, Any]:
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()]
    summary = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
    return {"detail": errors, "error": {"type": "InvalidRequest", "message": summary or "invalid request"}}


def internal_error_body(exc: Exception, who: str) -> dict[str, Any]:
    """A bug's answer in the one error shape (a typed 500, not Starlette's plain text), so a
    client raises InternalError; the traceback stays in ``who``'s log, not on the wire."""
    message = f"internal error ({type(exc).__name__}): a bug; the {who}'s log has its traceback"
    return {"detail": message, "error": {"type": "InternalError", "message": message}}


class BodyLimitMiddleware:
    """Refuses request bodies over a limit with 413 before they are held in memory:
    ``limit`` for JSON routes, ``raw_limit`` (None: none) for the raw file upload, whose
    body is streamed into the sandbox (where its disk quota applies). A declared length is
    checked at once; a chunked body is counted as it is read."""

    def __init__(self, app: Callable, limit: int, raw_limit: Optional[int] = None) -> None:
        self.app = app
        self.limit = limit
        self.raw_limit = raw_limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.raw_limit if scope["path"].endswith("/files/raw") else self.limit
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = next((value for key, value in scope["headers"] if key == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit)
            return
        seen, started, refused = 0, False, False

        async def counting_receive() -> dict:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # answer now; the app sees the client go away
                    refused = True
                    if not started:
                        await self._refuse(scope, receive, send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def watching_send(message: dict) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out; whatever the app says now is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except Exception:
            if not refused:
                raise

    @staticmethod
    async def _refuse(scope: dict, receive: Callable, send: Callable, limit: int) -> None:
        error = PayloadTooLarge(f"request body larger than this route's limit of {limit} bytes"
                                + ("" if scope["path"].endswith("/files/raw") else "; send files with PUT .../files/raw"))
        await JSONResponse(error.to_body(), status_code=error.status_code)(scope, receive, send)


class ApiKeyMiddleware:
    """Checks ``X-API-Key`` on every route but ``/`` and ``/health``. Plain ASGI: the
    ``@app.middleware`` style costs a task group per request on the hot path.

    ``scoped`` (the agent's) may accept other keys for some paths: it gets the path and
    the given key and says yes or no (per-sandbox tokens)."""

    def __init__(self, app: Callable, token: str, scoped: Optional[Callable[[str, str], bool]] = None) -> None:
        self.app = app
        self.token = token.encode()
        self.scoped = scoped

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((value for key, value in scope["headers"] if key == b"x-api-key"), b"")
            if not secrets.compare_digest(given, self.token) and not (
                    self.scoped is not None and given and self.scoped(scope["path"], given.decode(errors="replace"))):
                error = AuthenticationFailed("missing or wrong X-API-Key")
                await JSONResponse(error.to_body(), status_code=error.status_code)(scope, receive, send)
                return
        await self.app(scope, receive, send)
