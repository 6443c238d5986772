"""The per-job relay's limits on connections that have not shown a key: in all and per peer.

With one global limit of 256, any open sandbox could hold every slot and block new
connections to every per-job sandbox on the node, even ones with the master key.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from orchard_slurm.relay import HEAD_DEADLINE, MAX_UNAUTHENTICATED_PER_PEER, Relay, listening_socket

TOKEN = "master-token-for-the-test"


async def fake_agent(listener: socket.socket) -> asyncio.AbstractServer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(answer, sock=listener)


def test_one_peer_cannot_take_every_slot_from_another(tmp_path: Path):
    async def scenario() -> None:
        listener = listening_socket(tmp_path / "relay")
        agent = await fake_agent(listener)
        relay = Relay(tmp_path / "relay" / "agent.sock", TOKEN, "sbx-test")
        server = await relay.start("127.0.0.1")
        port = server.sockets[0].getsockname()[1]
        flood = []
        for _ in range(MAX_UNAUTHENTICATED_PER_PEER + 8):  # silent connections from 127.0.0.1
            flood.append(await asyncio.open_connection("127.0.0.1", port))
        await asyncio.sleep(0.2)
        closed = 0
        for reader, _ in flood:
            try:
                closed += await asyncio.wait_for(reader.read(1), 0.05) == b""
            except asyncio.TimeoutError:
                pass
        assert closed == 8, closed  # the flood's own excess, at once
        other = socket.socket()
        other.bind(("127.0.0.2", 0))  # another peer, while the first still holds its slots
        other.connect(("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=other)
        writer.write(f"GET /health HTTP/1.1\r\nhost: x\r\nx-api-key: {TOKEN}\r\n\r\n".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok"), answer
        started = time.monotonic()
        for reader, _ in flood[:MAX_UNAUTHENTICATED_PER_PEER]:  # the silent ones go at the deadline
            assert await asyncio.wait_for(reader.read(1), HEAD_DEADLINE + 3) == b""
        assert time.monotonic() - started < HEAD_DEADLINE + 3
        for _, flood_writer in flood:
            flood_writer.close()
        writer.close()
        server.close()
        agent.close()

    asyncio.run(scenario())
