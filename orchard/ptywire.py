"""The wire of ``WS /sandboxes/{id}/exec/pty`` (compatible with the original Orchard Env),
shared by the agent, the server's relay and the SDK: frames, close codes, and where a
WebSocket client may put its key.

JSON text frames. Client to server: ``init`` once, then ``stdin {data: base64}``,
``signal {sig}``, ``resize {rows, cols}``, ``close``. Server to client: ``ready {pid}``,
``stdout {data: base64}``, ``exit {code}`` (negative when signalled), ``error {message}``;
the server closes the socket after ``exit`` or ``error``. Our additions (extra fields an
original client ignores): ``ready.session_id`` and ``init.attach`` to reattach to a process
whose connection dropped, and ``error.error_type``, the typed error's name.
"""

from __future__ import annotations

import base64
import binascii
import json
import signal
from typing import Any, Literal, Optional, Union
from urllib.parse import parse_qsl, urlencode

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchard.errors import InvalidRequest, OrchardError

# Close codes of refusals (before any frame), as the original sends them.
CLOSE_BAD_KEY = 4401
CLOSE_UNKNOWN_SANDBOX = 4404
CLOSE_NOT_READY = 4409
CLOSE_AGENT_UNREACHABLE = 4503
CLOSE_NORMAL = 1000

SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL, "INT": signal.SIGINT, "HUP": signal.SIGHUP,
           "QUIT": signal.SIGQUIT}
KEY_PROTOCOL_PREFIX = "api_key."
MAX_FRAME_BYTES = 1 << 20  # a stdin frame's base64 text; larger frames are refused
OUTPUT_CHUNK = 1 << 16  # bytes of terminal output per stdout frame


class InitFrame(BaseModel):
    """The first frame: what to run. Unknown fields are ignored, null means default."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["init"]
    cmd: Optional[list[str]] = Field(None, min_length=1, max_length=4096)
    env: Optional[dict[str, str]] = None
    cwd: Optional[str] = Field(None, max_length=4096)
    rows: Optional[int] = Field(None, ge=1, le=10000)
    cols: Optional[int] = Field(None, ge=1, le=10000)
    login_shell: Optional[bool] = None
    attach: Optional[str] = Field(None, max_length=64, description="ours: the session_id of a detached process")


class StdinFrame(BaseModel):
    type: Literal["stdin"]
    data: str = Field(max_length=MAX_FRAME_BYTES)


class SignalFrame(BaseModel):
    type: Literal["signal"]
    sig: Literal["TERM", "KILL", "INT", "HUP", "QUIT"]


class ResizeFrame(BaseModel):
    type: Literal["resize"]
    rows: int = Field(ge=1, le=10000)
    cols: int = Field(ge=1, le=10000)


class CloseFrame(BaseModel):
    type: Literal["close"]


ClientFrame = Union[StdinFrame, SignalFrame, ResizeFrame, CloseFrame]
_FRAMES: dict[str, type[BaseModel]] = {"init": InitFrame, "stdin": StdinFrame, "signal": SignalFrame,
                                       "resize": ResizeFrame, "close": CloseFrame}


def parse_frame(text: Union[str, bytes, None]) -> BaseModel:
    """One client frame, validated; a bad one is an InvalidRequest naming the field."""
    if text is None:
        raise InvalidRequest("frames are JSON text")
    if len(text) > MAX_FRAME_BYTES + 1024:
        raise InvalidRequest(f"frame larger than {MAX_FRAME_BYTES} bytes; send stdin in pieces")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidRequest("a frame is not valid JSON") from None
    kind = raw.get("type") if isinstance(raw, dict) else None
    model = _FRAMES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidRequest(f"type: unknown frame type {kind!r}; expected one of {', '.join(_FRAMES)}")
    try:
        return model.model_validate({k: v for k, v in raw.items() if v is not None or k == "type"})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "frame"
        raise InvalidRequest(f"{kind} frame: {where}: {first['msg']}") from None


def decode_data(frame: StdinFrame) -> bytes:
    try:
        return base64.b64decode(frame.data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("stdin frame: data: not valid base64") from None


def ready(pid: int, session_id: str) -> str:
    return json.dumps({"type": "ready", "pid": pid, "session_id": session_id})


def stdout(data: bytes) -> str:
    return json.dumps({"type": "stdout", "data": base64.b64encode(data).decode()})


def exited(code: int) -> str:
    return json.dumps({"type": "exit", "code": code})


def error(exc: Union[OrchardError, str]) -> str:
    if isinstance(exc, OrchardError):
        return json.dumps({"type": "error", "message": exc.message, "error_type": type(exc).__name__})
    return json.dumps({"type": "error", "message": exc})


def key_from_scope(scope: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
    """(the key a WebSocket client sent, the subprotocol to answer with). Looks at the
    ``api_key`` query parameter (removed from the scope at once, so no log line of the URL
    carries it), a ``Sec-WebSocket-Protocol`` entry ``api_key.<key>``, and ``X-API-Key``."""
    key: Optional[str] = None
    query = scope.get("query_string", b"").decode("latin-1")
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        kept = [(k, v) for k, v in pairs if k != "api_key"]
        if len(kept) != len(pairs):
            key = next(v for k, v in pairs if k == "api_key")
            scope["query_string"] = urlencode(kept).encode()
    offered = list(scope.get("subprotocols") or [])
    answer = next((p for p in offered if not p.startswith(KEY_PROTOCOL_PREFIX)), None)
    for protocol in offered:
        if protocol.startswith(KEY_PROTOCOL_PREFIX):
            key = key or protocol[len(KEY_PROTOCOL_PREFIX):]
            answer = answer or protocol  # browsers drop a socket whose offered protocols all go unanswered
    for name, value in scope.get("headers", []):
        if name == b"x-api-key" and key is None:
            key = value.decode("latin-1")
    return key, answer


def refusal_code(exc: OrchardError) -> int:
    """The close code of a refusal before the first frame."""
    from orchard.errors import AgentUnreachable, AuthenticationFailed, SandboxNotFound

    if isinstance(exc, AuthenticationFailed):
        return CLOSE_BAD_KEY
    if isinstance(exc, SandboxNotFound):
        return CLOSE_UNKNOWN_SANDBOX
    if isinstance(exc, AgentUnreachable):
        return CLOSE_AGENT_UNREACHABLE
    return CLOSE_NOT_READY


async def refuse(ws: Any, protocol: Optional[str], exc: OrchardError) -> None:
    """Refuse a starlette WebSocket with the close code for ``exc`` (accepted first: a
    close code only exists after the handshake)."""
    await ws.accept(subprotocol=protocol)
    await ws.close(refusal_code(exc), close_reason(exc.message))


def close_reason(message: str) -> str:
    """Close reasons are at most 123 bytes."""
    data = message.encode()[:120]
    return data.decode(errors="ignore")
