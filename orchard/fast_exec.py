"""``POST /sandboxes/{id}/exec`` without FastAPI's routing and dependency solving.

Exec is the one call a trainer makes thousands of times a minute. On it, Starlette's
routing and FastAPI's request handling (route matching, dependency solving, the exception
and exit-stack layers) cost about a fifth of the server's CPU per command. This plain ASGI
layer answers it directly: the same body parsing (:func:`parse_body`), the same operation,
the app's own exception handlers for the error bodies. It sits innermost among the app's
middlewares (add it first), so auth, body limits, call tracking and request logs apply as
before. Anything it does not take (another method, a mounted root path) goes on to the
FastAPI route, which stays the one the OpenAPI schema describes.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from orchard.errors import OrchardError
from orchard.models import ExecRequest
from orchard.webapi import json_body, parse_body

EXEC_PATH = re.compile(r"/sandboxes/([^/]+)/exec")  # the route's path; ``{sandbox_id}`` matches [^/]+


class FastExecRoute:
    def __init__(self, app: Callable, ops: Any, api: FastAPI) -> None:
        self.app = app
        self.ops = ops  # a SandboxOperations (orchard.routes)
        self.api = api  # whose exception handlers answer errors

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        match = EXEC_PATH.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is None or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer; nothing was started
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        key = next((value.decode("latin-1") for name, value in scope["headers"] if name == b"idempotency-key"), None)
        try:
            request = parse_body(ExecRequest, b"".join(chunks))
            result = self.ops.exec(match.group(1), request, key)
            body = json_body(await result if inspect.isawaitable(result) else result)
        except (OrchardError, RequestValidationError) as exc:
            await self._error(scope, receive, send, exc)
            return
        data = body.encode() if isinstance(body, str) else body
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]})
        await send({"type": "http.response.body", "body": data})

    async def _error(self, scope: dict, receive: Callable, send: Callable, exc: Exception) -> None:
        """Answered by the handler the app registered for it, as FastAPI's route would be."""
        handler = next((h for h in map(self.api.exception_handlers.get, type(exc).__mro__) if h is not None), None)
        if handler is None:
            raise exc
        response = await handler(Request(scope, receive), exc)
        await response(scope, receive, send)
