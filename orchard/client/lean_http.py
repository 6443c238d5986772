"""Keep-alive HTTP/1.1 for the SDK's and the server's small JSON calls, on asyncio's
protocols and httptools' parser (the one uvicorn serves with).

Every command through the server crosses two HTTP clients (SDK -> server -> agent). On
aiohttp's client each call cost about 0.2 ms of CPU; this one costs about 0.06 ms
(docs/benchmarks.md). It does only what those calls need: a request whose head and body
are bytes in hand, one answer read whole (capped), plain TCP or a Unix socket. TLS,
streamed bodies, downloads, NDJSON streams and WebSockets stay on aiohttp
(:mod:`orchard.client.http` picks).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from typing import Optional

import httptools

from orchard.errors import AnswerTooLarge

IDLE_REUSE_SECONDS = 50.0  # both our servers keep an idle connection for 60 s
SAFE_TARGET = re.compile(r"[A-Za-z0-9/_.~!$&'()*+,;=:@%?-]+")  # sent as is; anything else goes to aiohttp
SAFE_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")
MAX_HEAD = 64 << 10  # an answer's status line and headers (aiohttp: 8,190 bytes a line, 128 lines)


ERROR_ANSWER_CAP = 1 << 20  # an error's body is a small JSON: read it whatever cap the caller set


def answer_cap(cap: Optional[int], status: int) -> Optional[int]:
    """The cap for an answer of this status: the caller's is for what it asked for, not for
    an error's body, which tells what went wrong."""
    return cap if cap is None or status < 400 else max(cap, ERROR_ANSWER_CAP)


class LeanConnectionError(ConnectionError):
    """The connection failed before a whole answer arrived; ``sent_nothing_back`` says no
    byte of an answer came (then a reused connection was stale, and a retry is safe)."""

    def __init__(self, message: str, sent_nothing_back: bool = False) -> None:
        super().__init__(message)
        self.sent_nothing_back = sent_nothing_back


class _Connection(asyncio.Protocol):
    """One connection and the one answer it is waiting for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: Optional[asyncio.Transport] = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = time.monotonic()
        self.timer: Optional[asyncio.TimerHandle] = None
        self._reset(None, None)

    def _reset(self, waiter: "Optional[asyncio.Future[tuple[int, bytes]]]", cap: Optional[int]) -> None:
        self.waiter, self.cap = waiter, cap
        self.body: list[bytes] = []
        self.size = 0
        self.answered = False  # a byte of the answer came
        self.headers_done = False
        self.until_close = False  # neither a length nor chunks: the body ends with the connection
        self.framed = False
        self.keep_alive = False  # read when the answer is complete: the parser forgets it after
        self.complete = False
        self.head_size = 0
        self.length: Optional[int] = None  # the answer's Content-Length, when it says one
        self.last_data = self.loop.time()

    # -- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.answered = True
        self.last_data = self.loop.time()
        if self.waiter is None or self.waiter.done():  # nothing (more) asked: talking out of turn
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(LeanConnectionError("the server switched protocols on a plain call"))
            return
        except httptools.HttpParserError as exc:
            self._fail(LeanConnectionError(f"malformed HTTP answer: {exc}"))
            return
        if not self.headers_done:  # counted after parsing: one read may hold a head and a large body
            self.head_size += len(data)
            if self.head_size > MAX_HEAD:  # the parser keeps a growing header by copying it: stop early
                self._fail(LeanConnectionError(f"an answer's head of more than {MAX_HEAD} bytes"))

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.headers_done and self.until_close:
                self._finish()
            else:
                self.waiter.set_exception(LeanConnectionError(
                    f"the connection closed before the whole answer ({exc or 'closed by the server'})",
                    sent_nothing_back=not self.answered))

    # -- httptools callbacks -------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True
            if name.lower() == b"content-length" and value.strip().isdigit():
                self.length = int(value)

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request
            self._fail(LeanConnectionError("answered more than once"))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # informational (100, 103): the real answer follows
            self.framed = False
            return
        self.headers_done = True
        self.until_close = not self.framed and status not in (204, 304)
        self.cap = answer_cap(self.cap, status)
        if self.cap is not None and self.length is not None and self.length > self.cap:
            self._fail(AnswerTooLarge(f"answered more than {self.cap} bytes (its length: {self.length}); refused"))

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.cap is not None and self.size > self.cap:
            self._fail(AnswerTooLarge(f"answered more than {self.cap} bytes; refused"))
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if not self.headers_done:  # the end of an informational answer
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._finish()

    # -- ours ----------------------------------------------------------------------
    def _finish(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def reusable(self) -> bool:
        return (not self.closed and self.complete and self.keep_alive and not self.until_close
                and not self.transport.is_closing())  # type: ignore[union-attr]

    async def exchange(self, data: bytes, cap: Optional[int], timeout: Optional[float]) -> tuple[int, bytes]:
        """Send ``data`` (a whole request) and read its answer; a silence of ``timeout``
        seconds (None: no limit) raises asyncio.TimeoutError. Afterwards, ``reusable()`` says
        whether the connection can take another request."""
        waiter: asyncio.Future[tuple[int, bytes]] = self.loop.create_future()
        self._reset(waiter, cap)
        if timeout is not None:
            self.timer = self.loop.call_later(timeout, self._check_silence, waiter, timeout)
        try:
            if self.closed or self.transport.is_closing():  # type: ignore[union-attr]
                # Closed by the server between connecting and this write (an agent killed with
                # the connection in its backlog): uvloop raises RuntimeError on the write, which
                # went out as a 500 (found in CI). Nothing was sent: a retry is safe.
                raise LeanConnectionError("the connection closed before the request was sent", sent_nothing_back=True)
            self.transport.write(data)  # type: ignore[union-attr]
            return await waiter
        except BaseException:
            self.close()  # half an exchange: nobody knows what the next bytes would belong to
            raise
        finally:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.waiter = None

    def _check_silence(self, waiter: "asyncio.Future[tuple[int, bytes]]", timeout: float) -> None:
        if waiter.done():
            return
        quiet = self.loop.time() - self.last_data
        if quiet >= timeout:
            waiter.set_exception(asyncio.TimeoutError())
        else:  # data came meanwhile: wait out the rest of the silence from the last byte
            self.timer = self.loop.call_later(timeout - quiet, self._check_silence, waiter, timeout)


class LeanPool:
    """Keep-alive connections to one origin, at most ``limit`` open at once."""

    def __init__(self, host: str, port: int, uds: Optional[str], limit: int) -> None:
        self.host, self.port, self.uds = host, port, uds
        self.loop = asyncio.get_running_loop()
        self.idle: deque[_Connection] = deque()
        self.slots = asyncio.Semaphore(limit)
        self.closed = False

    async def _connect(self, connect_timeout: float) -> _Connection:
        factory = lambda: _Connection(self.loop)  # noqa: E731
        try:
            if self.uds is not None:
                opening = self.loop.create_unix_connection(factory, self.uds)
            else:
                opening = self.loop.create_connection(factory, self.host, self.port)
            _, connection = await asyncio.wait_for(opening, connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            where = self.uds if self.uds is not None else f"{self.host}:{self.port}"
            raise LeanConnectionError(f"Cannot connect to {where}: {exc}") from None
        return connection  # type: ignore[return-value]

    def _reuse(self) -> Optional[_Connection]:
        now = time.monotonic()
        while self.idle:
            connection = self.idle.pop()  # the most recently used: the least likely to be stale
            if connection.reusable() and now - connection.idle_since < IDLE_REUSE_SECONDS:
                return connection
            connection.close()
        return None

    async def _take_slot(self, connect_timeout: float) -> None:
        """As aiohttp's connect timeout did, it also bounds the wait for a free connection."""
        if not self.slots.locked():
            await self.slots.acquire()
            return
        try:
            await asyncio.wait_for(self.slots.acquire(), connect_timeout)
        except asyncio.TimeoutError:
            raise LeanConnectionError(f"no free connection within {connect_timeout:g} s") from None

    async def send(self, data: bytes, cap: Optional[int], timeout: Optional[float], connect_timeout: float,
                   retry_stale: bool) -> tuple[int, bytes]:
        """One request, its answer: (status, body). A reused connection that turns out to have
        been closed by the server before answering is replaced once when ``retry_stale``."""
        await self._take_slot(connect_timeout)
        try:
            connection = self._reuse()
            reused = connection is not None
            while True:
                if connection is None:
                    connection = await self._connect(connect_timeout)
                try:
                    answer = await connection.exchange(data, cap, timeout)
                except LeanConnectionError as exc:
                    if reused and retry_stale and exc.sent_nothing_back:
                        connection, reused = None, False
                        continue
                    raise
                if connection.reusable() and not self.closed:
                    connection.idle_since = time.monotonic()
                    self.idle.append(connection)
                else:
                    connection.close()
                return answer
        finally:
            self.slots.release()

    def close(self) -> None:
        self.closed = True
        while self.idle:
            self.idle.pop().close()

    def forget(self) -> None:
        """Drop a pool whose event loop has closed: its transports can no longer be closed
        through that loop, so the reference cycles are broken and each transport, freed at
        once, closes its socket itself."""
        self.closed = True
        while self.idle:
            connection = self.idle.pop()
            connection.transport = None
            connection.parser = None  # type: ignore[assignment]
