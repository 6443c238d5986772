"""The per-job relay: TCP on the compute node to the agent inside the sandbox's container.

The agent serves on a listening Unix socket that this job creates in a directory of its
own (never bound into the container) and hands to the container as an inherited file
descriptor, so there is no socket path a sandbox could replace: the relay can only ever
reach that agent, never a socket such as munge's. The relay also checks each connection's
key before relaying a byte (the job's master token, or this sandbox's own per-sandbox
token) and closes connections that do not send a request head in time. Connections still
owing their head are limited per peer address as well as in all: one peer (a node whose
open sandboxes flood the relay) cannot take every slot from the server holding the key.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
from pathlib import Path
from typing import Optional

from orchard.agent.tokens import PREFIX, token_matches

HEAD_LIMIT = 16 << 10  # a request head larger than this is no request of ours
HEAD_DEADLINE = 2.0  # seconds an unauthenticated connection may stay open
MAX_UNAUTHENTICATED = 256  # connections still owing their request head; more are closed at once
MAX_UNAUTHENTICATED_PER_PEER = 32  # of those, from one peer address
_REFUSED = (b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s")


def listening_socket(directory: Path) -> socket.socket:
    """A listening Unix socket in ``directory`` (created 0700: only this job's user)."""
    directory.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / "agent.sock"))
    listener.listen(128)
    listener.set_inheritable(True)
    return listener


def api_key(head: bytes) -> Optional[str]:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"x-api-key":
            return value.strip().decode(errors="replace")
    return None


class Relay:
    def __init__(self, socket_path: Path, token: str, sandbox_id: str) -> None:
        self.socket_path = socket_path
        self.token = token
        self.sandbox_id = sandbox_id
        self._incarnation: Optional[str] = None
        self._pending = 0  # connections that have not shown a key yet
        self._pending_by_peer: dict[str, int] = {}

    async def start(self, host: str) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._connect, host, 0, limit=HEAD_LIMIT)

    async def agent_request(self, method: str, path: str) -> tuple[int, bytes]:
        """One request to the agent with the master token (health, the sandbox's incarnation)."""
        reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
        try:
            writer.write(f"{method} {path} HTTP/1.1\r\nhost: agent\r\nx-api-key: {self.token}\r\n"
                         "connection: close\r\n\r\n".encode())
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
        status_line, _, rest = answer.partition(b"\r\n")
        parts = status_line.split()
        return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), rest.partition(b"\r\n\r\n")[2]

    async def _allowed(self, key: Optional[str]) -> bool:
        if key is None:
            return False
        if hmac.compare_digest(key.encode(), self.token.encode()):
            return True
        if not key.startswith(PREFIX):
            return False
        if self._incarnation is None or not token_matches(key, self.token, self.sandbox_id, self._incarnation):
            status, body = await self.agent_request("GET", f"/sandboxes/{self.sandbox_id}")
            try:
                self._incarnation = json.loads(body).get("incarnation") if status == 200 else None
            except ValueError:
                self._incarnation = None
        return self._incarnation is not None and token_matches(key, self.token, self.sandbox_id, self._incarnation)

    async def _connect(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        peer = client_writer.get_extra_info("peername")
        peer_host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self._pending >= MAX_UNAUTHENTICATED or self._pending_by_peer.get(peer_host, 0) >= MAX_UNAUTHENTICATED_PER_PEER:
            client_writer.close()  # a flood of silent connections must not exhaust our fds, nor one peer our slots
            return
        self._pending += 1
        self._pending_by_peer[peer_host] = self._pending_by_peer.get(peer_host, 0) + 1
        try:
            head = await asyncio.wait_for(client_reader.readuntil(b"\r\n\r\n"), HEAD_DEADLINE)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            client_writer.close()
            return
        finally:
            self._pending -= 1
            left = self._pending_by_peer.pop(peer_host) - 1
            if left:
                self._pending_by_peer[peer_host] = left
        if not await self._allowed(api_key(head)):
            body = b'{"detail":"missing or wrong X-API-Key","error":{"type":"AuthenticationFailed",' \
                   b'"message":"missing or wrong X-API-Key"}}'
            client_writer.write(_REFUSED % (len(body), body))
            await client_writer.drain()
            client_writer.close()
            return
        try:
            agent_reader, agent_writer = await asyncio.open_unix_connection(str(self.socket_path))
        except OSError:
            client_writer.close()
            return
        agent_writer.write(head)
        await asyncio.gather(_pipe(client_reader, agent_writer), _pipe(agent_reader, client_writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
