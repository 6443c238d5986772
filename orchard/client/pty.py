"""``AsyncPty``: the SDK's handle on an interactive process (``WS .../exec/pty``), the same
against a server, in process, or straight to an agent. Frames are read only when the
caller reads, so a caller that stops reading stops the process (back-pressure).
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any, Optional, Union

import aiohttp

from orchard import ptywire
from orchard.errors import (
    ERRORS_BY_NAME, AgentUnreachable, AuthenticationFailed, InternalError, OrchardError, SandboxNotFound,
    SandboxNotReady,
)

_REFUSALS: dict[int, type[OrchardError]] = {
    ptywire.CLOSE_BAD_KEY: AuthenticationFailed, ptywire.CLOSE_UNKNOWN_SANDBOX: SandboxNotFound,
    ptywire.CLOSE_NOT_READY: SandboxNotReady, ptywire.CLOSE_AGENT_UNREACHABLE: AgentUnreachable,
}


def error_of(frame: dict) -> OrchardError:
    cls = ERRORS_BY_NAME.get(str(frame.get("error_type")), OrchardError)
    return cls(str(frame.get("message", "interactive process failed")))


class AsyncPty:
    """An interactive process: ``write_stdin``, ``read``, ``read_all``, ``kill``, ``resize``,
    ``wait``, ``close``; ``async with`` closes it."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, ready: dict) -> None:
        self._ws = ws
        self.pid: int = ready["pid"]
        self.session_id: Optional[str] = ready.get("session_id")
        self.exit_code: Optional[int] = None
        self.error: Optional[OrchardError] = None

    @classmethod
    async def open(cls, api: Any, sandbox_id: str, cmd: Optional[list[str]] = None, *,
                   env: Optional[dict[str, str]] = None, cwd: Optional[str] = None, rows: int = 24, cols: int = 80,
                   login_shell: bool = False, attach: Optional[str] = None) -> "AsyncPty":
        ws = await api.websocket(f"/sandboxes/{sandbox_id}/exec/pty")
        try:
            await ws.send_str(json.dumps({"type": "init", "cmd": cmd, "env": env, "cwd": cwd, "rows": rows,
                                          "cols": cols, "login_shell": login_shell, "attach": attach}))
            message = await ws.receive()
            if message.type != aiohttp.WSMsgType.TEXT:
                code = ws.close_code or 0
                raise _REFUSALS.get(code, InternalError)(f"interactive process refused (close code {code}): "
                                                         f"{message.extra or ''}")
            frame = json.loads(message.data)
            if frame.get("type") == "error":
                raise error_of(frame)
            return cls(ws, frame)
        except BaseException:
            await ws.close()
            raise

    async def __aenter__(self) -> "AsyncPty":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def done(self) -> bool:
        return self.exit_code is not None or self.error is not None

    async def _next_output(self) -> Optional[bytes]:
        """The next stdout chunk, or None once the process ended (``exit`` or ``error``)."""
        while not self.done:
            message = await self._ws.receive()
            if message.type != aiohttp.WSMsgType.TEXT:
                self.error = AgentUnreachable(f"the interactive process's connection closed "
                                              f"(code {self._ws.close_code})")
                break
            frame = json.loads(message.data)
            kind = frame.get("type")
            if kind == "stdout":
                return base64.b64decode(frame["data"])
            if kind == "exit":
                self.exit_code = int(frame["code"])
            elif kind == "error":
                self.error = error_of(frame)
        return None

    async def read(self, timeout: Optional[float] = None) -> bytes:
        """The next output, or b"" when nothing came within ``timeout`` or the process ended
        (see ``done``)."""
        if self.done:
            return b""
        try:
            chunk = await asyncio.wait_for(asyncio.shield(self._pending()), timeout)
        except asyncio.TimeoutError:
            return b""
        self._reading = None
        return chunk or b""

    def _pending(self) -> "asyncio.Future[Optional[bytes]]":
        """One outstanding receive, kept across timeouts so no frame is lost."""
        reading = getattr(self, "_reading", None)
        if reading is None:
            reading = self._reading = asyncio.ensure_future(self._next_output())
        return reading

    async def read_all(self, timeout: Optional[float] = None) -> bytes:
        """Everything until the process ends (or ``timeout`` passes)."""
        chunks: list[bytes] = []
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self.done:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            chunks.append(await self.read(left))
        return b"".join(chunks)

    async def _send(self, **frame: Any) -> None:
        if self.done:
            return
        try:
            await self._ws.send_str(json.dumps(frame))
        except (ConnectionError, aiohttp.ClientError):
            pass  # it ended; reading says how

    async def write_stdin(self, data: Union[bytes, str]) -> None:
        raw = data.encode() if isinstance(data, str) else data
        for start in range(0, len(raw), 1 << 18):
            await self._send(type="stdin", data=base64.b64encode(raw[start:start + (1 << 18)]).decode())

    async def kill(self, sig: str = "KILL") -> None:
        """Signal the process group (TERM, KILL, INT, HUP, QUIT)."""
        if sig not in ptywire.SIGNALS:
            raise ValueError(f"sig must be one of {', '.join(ptywire.SIGNALS)}")
        await self._send(type="signal", sig=sig)

    async def resize(self, rows: int, cols: int) -> None:
        await self._send(type="resize", rows=rows, cols=cols)

    async def wait(self, timeout: Optional[float] = None) -> int:
        """The exit code (negative when a signal ended it); output read meanwhile is dropped.
        Raises the typed error when the process ended in ``error``."""
        await self.read_all(timeout)
        if self.error is not None:
            raise self.error
        if self.exit_code is None:
            raise asyncio.TimeoutError(f"the interactive process still runs after {timeout}s")
        return self.exit_code

    async def close(self) -> None:
        """End the process (if it runs) and the connection."""
        if not self.done:
            await self._send(type="close")
        await self._ws.close()
