"""Connections the server takes: a cap, a deadline for each request's head, and a record of
when it last had to refuse.

uvicorn keeps a connection that never sends a request for as long as the peer likes, and
accepts as many as it is given: about 40,000 idle connections from one sandbox with network
used up the server's open files, requests failed, and the reconciler then deleted other
sandboxes for heartbeats it could not receive. Here a connection past ``max_connections``
is closed as it arrives, one whose request head (request line and headers) is not complete
``header_timeout`` seconds after it connected or began that request is closed, and
``ConnectionGuard.refused_within`` tells the reconciler to reap no sandbox for a missed
heartbeat while the server itself was turning callers away.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Optional

log = logging.getLogger("orchard.server")

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # uvicorn[standard]: the parser's callbacks


class ConnectionGuard:
    """The limits, and when the last connection was refused (monotonic seconds)."""

    def __init__(self, max_connections: int, header_timeout: float) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.last_refused: Optional[float] = None
        self.refused = 0
        self.slow_heads = 0

    def refuse(self) -> None:
        self.refused += 1
        if self.last_refused is None or time.monotonic() - self.last_refused > 10:
            log.warning("connection refused: max_connections (%d) reached", self.max_connections)
        self.last_refused = time.monotonic()

    def refused_within(self, seconds: float) -> bool:
        return self.last_refused is not None and time.monotonic() - self.last_refused < seconds

    def protocol(self) -> type:
        """A uvicorn HTTP protocol class that applies this guard."""
        guard = self

        class GuardedProtocol(HttpToolsProtocol):
            _head_timer: Optional[asyncio.TimerHandle] = None

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                if len(self.connections) > guard.max_connections:
                    guard.refuse()
                    transport.abort()
                    return
                self._start_head_timer()

            def _start_head_timer(self) -> None:
                if self._head_timer is None:
                    self._head_timer = self.loop.call_later(guard.header_timeout, self._head_too_slow)

            def _stop_head_timer(self) -> None:
                if self._head_timer is not None:
                    self._head_timer.cancel()
                    self._head_timer = None

            def _head_too_slow(self) -> None:
                self._head_timer = None
                guard.slow_heads += 1
                if not self.transport.is_closing():
                    self.transport.abort()

            def connection_lost(self, exc: Optional[Exception]) -> None:
                self._stop_head_timer()
                super().connection_lost(exc)

            def on_message_begin(self) -> None:
                super().on_message_begin()
                self._start_head_timer()

            def on_headers_complete(self) -> None:
                self._stop_head_timer()
                super().on_headers_complete()

        return GuardedProtocol


def raise_open_files_limit() -> int:
    """Let the server use every descriptor its hard limit allows; returns that limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard
