"""``WS /sandboxes/{id}/exec/pty`` on the agent: one connection drives one interactive
process (see :mod:`orchard.ptywire` for the frames). Output is read from the terminal only
after the previous frame went out, so the socket's own flow control bounds what we hold.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable, Optional

from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from orchard import ptywire
from orchard.agent.pty_process import PtyProcess
from orchard.agent.pty_sessions import PtySession
from orchard.errors import AuthenticationFailed, InvalidRequest, OrchardError

if TYPE_CHECKING:
    from orchard.agent.service import AgentService

log = logging.getLogger("orchard.agent")
INIT_TIMEOUT = 30.0
DRAIN_LIMIT = 16  # chunks read after the process ended (a background writer must not keep us here)
STDIN_BACKLOG = ptywire.MAX_FRAME_BYTES  # stdin held while the process is not reading its terminal


async def send_error_and_close(ws: WebSocket, exc: OrchardError) -> None:
    try:
        await ws.send_text(ptywire.error(exc))
        await ws.close(ptywire.CLOSE_NORMAL)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass


async def receive_init(ws: WebSocket) -> ptywire.InitFrame:
    try:
        message = await asyncio.wait_for(ws.receive(), INIT_TIMEOUT)
    except asyncio.TimeoutError:
        raise InvalidRequest(f"no init frame within {INIT_TIMEOUT:g}s") from None
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    frame = ptywire.parse_frame(message.get("text") or message.get("bytes"))
    if not isinstance(frame, ptywire.InitFrame):
        raise InvalidRequest(f"type: the first frame must be init, not {frame.type!r}")  # type: ignore[attr-defined]
    return frame


async def pump_output(ws: WebSocket, session: PtySession) -> None:
    """Terminal output to the client, then ``exit`` (or ``error``) and the close."""
    process = session.process
    assert session.supervisor is not None
    ended = asyncio.shield(session.supervisor)
    while True:
        chunk = session.pending
        if not chunk:
            reading = asyncio.ensure_future(process.read(ptywire.OUTPUT_CHUNK))
            try:
                await asyncio.wait([reading, ended], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the client left: a read left behind would keep the
                reading.cancel()  # master's number watched after it is closed (a later socket on it: EEXIST)
                if reading.done() and not reading.cancelled() and reading.exception() is None:
                    session.pending = reading.result()  # read already: kept for a reattach
                raise
            if not reading.done():
                reading.cancel()
                break
            chunk = reading.result()
            if not chunk:
                break
            session.pending = chunk
        session.touch()
        await ws.send_text(ptywire.stdout(chunk))
        session.pending = b""
    code = await ended
    for _ in range(DRAIN_LIMIT):
        chunk = process.read_now(ptywire.OUTPUT_CHUNK)
        if not chunk:
            break
        await ws.send_text(ptywire.stdout(chunk))
    problem = session.outcome()
    await ws.send_text(ptywire.error(problem) if problem is not None else ptywire.exited(code))
    await ws.close(ptywire.CLOSE_NORMAL)


class StdinWriter:
    """Stdin to the terminal in order, off the loop that reads frames: a process that does not
    read its terminal blocks only this, so a later signal, close or dropped connection is
    still seen. Up to STDIN_BACKLOG bytes wait here; past that, frames wait in the socket."""

    def __init__(self, process: PtyProcess) -> None:
        self.process = process
        self.queue: "asyncio.Queue[bytes]" = asyncio.Queue()
        self.held = 0
        self.room = asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    async def put(self, data: bytes) -> None:
        if not self.held:  # nothing waits: write what fits now, in step with the frames around it
            data = data[self.process.write_now(data):]
            if not data:
                return
        while self.held >= STDIN_BACKLOG:
            self.room.clear()
            await self.room.wait()
        self.held += len(data)
        self.queue.put_nowait(data)

    async def _run(self) -> None:
        while True:
            data = await self.queue.get()
            await self.process.write(data)
            self.held -= len(data)
            self.room.set()


async def pump_input(ws: WebSocket, session: PtySession) -> str:
    """Client frames to the process; returns "dropped" or "closed"."""
    process = session.process
    writer = StdinWriter(process)
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return "dropped"
            frame = ptywire.parse_frame(message.get("text") or message.get("bytes"))
            if isinstance(frame, ptywire.StdinFrame):
                session.touch()
                await writer.put(ptywire.decode_data(frame))
            elif isinstance(frame, ptywire.SignalFrame):
                process.signal(ptywire.SIGNALS[frame.sig])
            elif isinstance(frame, ptywire.ResizeFrame):
                process.resize(frame.rows, frame.cols)
            elif isinstance(frame, ptywire.CloseFrame):
                process.kill()
                return "closed"
            else:
                raise InvalidRequest("type: init was already sent")
    finally:
        writer.task.cancel()


async def drive(ws: WebSocket, service: "AgentService", session: PtySession) -> None:
    table = service.ptys
    output = asyncio.ensure_future(pump_output(ws, session))
    commands = asyncio.ensure_future(pump_input(ws, session))
    try:
        await asyncio.wait([output, commands], return_when=asyncio.FIRST_COMPLETED)
        if commands.done() and commands.exception() is None and commands.result() == "closed":
            await output  # the process was killed: its exit goes out, then the close
        elif commands.done() and isinstance(commands.exception(), OrchardError):
            output.cancel()
            process_problem = commands.exception()
            assert isinstance(process_problem, OrchardError)
            session.process.kill()
            await send_error_and_close(ws, process_problem)
            table.remove(session)
            return
        if output.done() and output.exception() is None:
            table.remove(session)
            return
    except asyncio.CancelledError:
        pass
    finally:
        for task in (output, commands):
            task.cancel()
        for task in (output, commands):
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.info("interactive process %s: %r", session.session_id, task.exception())
    if session.session_id in table.sessions:  # the connection went: wait for a reattach
        table.detach(session)


def add_pty_route(app: FastAPI, service: "AgentService", authorized: Callable[[Optional[str], str], bool]) -> None:
    @app.websocket("/sandboxes/{sandbox_id}/exec/pty")
    async def exec_pty(ws: WebSocket, sandbox_id: str) -> None:
        key, protocol = ptywire.key_from_scope(ws.scope)
        service.touch()
        try:
            if not authorized(key, sandbox_id):
                raise AuthenticationFailed("missing or wrong API key")
            sandbox = service._ready(sandbox_id)
        except OrchardError as exc:
            await ptywire.refuse(ws, protocol, exc)
            return
        await ws.accept(subprotocol=protocol)
        try:
            init = await receive_init(ws)
            if init.attach:
                session = service.ptys.attach(sandbox_id, init.attach)
            else:
                session = await service.ptys.open(service, service._ready(sandbox_id), init)
        except WebSocketDisconnect:
            return
        except OrchardError as exc:
            await send_error_and_close(ws, exc)
            return
        del sandbox
        try:
            await ws.send_text(ptywire.ready(session.process.sandbox_pid, session.session_id))
        except (WebSocketDisconnect, RuntimeError, OSError):
            service.ptys.detach(session)
            return
        try:
            await drive(ws, service, session)
        except Exception:  # never let one connection take the agent's loop with it
            log.exception("interactive process %s", session.session_id)
            if ws.client_state == WebSocketState.CONNECTED:
                await send_error_and_close(ws, OrchardError("internal error"))
            service.ptys.remove(session)
