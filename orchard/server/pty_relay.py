"""``WS /sandboxes/{id}/exec/pty`` on the server: checks the key and the sandbox, then
relays frames unchanged to the sandbox's agent (which runs the process) and back.

Frames are passed one at a time in each direction: the next frame from the agent is read
only once the client has taken the last one, so a client that stops reading stops the
process (back-pressure end to end), and the relay holds at most a frame per direction.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Optional
from urllib.parse import quote

import aiohttp
from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect

from orchard import ptywire
from orchard.errors import AgentUnreachable, AuthenticationFailed, OrchardError, SandboxLost
from orchard.server.service import ServerService


async def _down(upstream: aiohttp.ClientWebSocketResponse, ws: WebSocket) -> None:
    """Agent to client, then the agent's close code."""
    async for message in upstream:
        if message.type == aiohttp.WSMsgType.TEXT:
            await ws.send_text(message.data)
        elif message.type == aiohttp.WSMsgType.BINARY:
            await ws.send_bytes(message.data)
        else:
            break
    code = upstream.close_code or ptywire.CLOSE_NORMAL
    await ws.close(code if code != 1006 else ptywire.CLOSE_AGENT_UNREACHABLE)


async def _up(ws: WebSocket, upstream: aiohttp.ClientWebSocketResponse, service: ServerService,
              sandbox_id: str) -> None:
    """Client to agent, until the client goes."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        service.touch(sandbox_id)  # an interactive session counts as use of its sandbox
        if message.get("text") is not None:
            await upstream.send_str(message["text"])
        elif message.get("bytes") is not None:
            await upstream.send_bytes(message["bytes"])


def add_pty_relay(app: FastAPI, service: ServerService, api_key: Optional[str]) -> None:
    @app.websocket("/sandboxes/{sandbox_id}/exec/pty")
    async def exec_pty(ws: WebSocket, sandbox_id: str) -> None:
        key, protocol = ptywire.key_from_scope(ws.scope)
        try:
            if api_key is not None and not (key and secrets.compare_digest(key.encode(), api_key.encode())):
                raise AuthenticationFailed("missing or wrong API key")
            record = service.usable(sandbox_id)
            agent = await service.agent(sandbox_id)
            try:
                upstream = await agent.websocket(f"/sandboxes/{quote(sandbox_id, safe='')}/exec/pty")
            except AgentUnreachable as exc:
                reason = await service.confirm_lost(record)
                raise SandboxLost(f"sandbox {sandbox_id!r} was lost: {reason}") if reason else exc from None
        except OrchardError as exc:
            await ptywire.refuse(ws, protocol, exc)
            return
        await ws.accept(subprotocol=protocol)
        down = asyncio.ensure_future(_down(upstream, ws))
        up = asyncio.ensure_future(_up(ws, upstream, service, sandbox_id))
        try:
            await asyncio.wait([down, up], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (down, up):
                task.cancel()
            await upstream.close()  # a client that went: the agent keeps the process for a reattach
            for task in (down, up):
                try:
                    await task
                except (asyncio.CancelledError, WebSocketDisconnect, RuntimeError, OSError, aiohttp.ClientError):
                    pass
