"""HTTP pieces shared by the agent and the server: auth, the error body, fast responses."""

from __future__ import annotations

import json
import secrets
from typing import Any, Callable, Optional, TypeVar

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from orchard.errors import AuthenticationFailed

OPEN_PATHS = {"/", "/health"}
MAX_WAIT_SECONDS = 3600.0


def model_response(model: BaseModel | list[BaseModel] | dict | bytes, status_code: int = 200) -> Response:
    """Serialize with pydantic directly: FastAPI's generic encoder costs ~0.3 ms a call.
    ``bytes`` are JSON already (an agent's answer the server passes on)."""
    if isinstance(model, bytes):
        body: str | bytes = model
    elif isinstance(model, BaseModel):
        body = model.model_dump_json()
    elif isinstance(model, list):
        body = "[" + ",".join(m.model_dump_json() for m in model) + "]"
    else:
        body = json.dumps(model)
    return Response(content=body, status_code=status_code, media_type="application/json")


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
