"""A plain WebSocket client speaking exactly the frames of ``WS .../exec/pty`` (no SDK), for
tests through the server and straight to the agent. Every wait is bounded and fails with
what was seen."""

from __future__ import annotations

import base64
import json
import time
from typing import Any, Optional

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect, unix_connect

WAIT = 20.0


def open_socket(url: str, path: str, key: Optional[str] = None, *, via: str = "query",
                headers: Optional[dict] = None) -> ClientConnection:
    """``url`` is http://host:port or unix:///path; ``via`` says where the key goes:
    query, protocol (Sec-WebSocket-Protocol api_key.KEY) or header (X-API-Key)."""
    query = f"?api_key={key}" if key and via == "query" else ""
    protocols = [f"api_key.{key}"] if key and via == "protocol" else None
    extra = dict(headers or {})
    if key and via == "header":
        extra["X-API-Key"] = key
    if url.startswith("unix://"):
        connection = unix_connect(url.removeprefix("unix://"), f"ws://agent{path}{query}", subprotocols=protocols,
                                  additional_headers=extra, open_timeout=WAIT)
    else:
        connection = connect(url.replace("http://", "ws://") + path + query, subprotocols=protocols,
                             additional_headers=extra, open_timeout=WAIT)
    # Entered as its own context: websockets 17.1 deprecates using a bare connect(); the
    # tests read each socket to its close (the server's) or drop it with the test.
    return connection.__enter__()


class Frames:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.output = b""
        self.frames: list[dict] = []

    def send(self, **frame: Any) -> None:
        self.ws.send(json.dumps(frame))

    def init(self, cmd: Optional[list[str]] = None, **fields: Any) -> dict:
        self.send(type="init", cmd=cmd, **fields)
        return self.next()

    def stdin(self, text: str) -> None:
        self.send(type="stdin", data=base64.b64encode(text.encode()).decode())

    def next(self, timeout: float = WAIT) -> dict:
        frame = json.loads(self.ws.recv(timeout=timeout))
        self.frames.append(frame)
        if frame["type"] == "stdout":
            self.output += base64.b64decode(frame["data"])
        return frame

    def until_output(self, text: str, timeout: float = WAIT) -> bytes:
        """Read until ``text`` shows up in the output; returns the output so far."""
        deadline = time.monotonic() + timeout
        while text.encode() not in self.output:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not in output after {timeout}s: {self.output[-500:]!r}")
            frame = self.next(left)
            if frame["type"] in ("exit", "error"):
                raise AssertionError(f"ended before {text!r}: {frame}; output {self.output[-500:]!r}")
        return self.output

    def until_end(self, timeout: float = WAIT) -> dict:
        """Read to the ``exit`` or ``error`` frame; the server must close right after."""
        deadline = time.monotonic() + timeout
        while True:
            frame = self.next(max(0.01, deadline - time.monotonic()))
            if frame["type"] in ("exit", "error"):
                try:
                    self.ws.recv(timeout=WAIT)
                except ConnectionClosed:
                    return frame
                raise AssertionError(f"a frame after {frame}")

    def close_code(self, timeout: float = WAIT) -> int:
        """The close code of a socket the server refuses."""
        try:
            frame = self.ws.recv(timeout=timeout)
        except ConnectionClosed as exc:
            assert exc.rcvd is not None
            return exc.rcvd.code
        raise AssertionError(f"expected a refusal, got {frame}")


def python_repl(term: Frames, exit_code: int) -> None:
    """A Python REPL on ``term`` (already ``ready``): evaluate, resize, see the new size, exit."""
    term.until_output(">>> ")
    term.stdin("print(sum(range(10)))\n")
    term.until_output("45")
    term.send(type="resize", rows=50, cols=132)
    term.stdin("import shutil; print(shutil.get_terminal_size())\n")
    term.until_output("os.terminal_size(columns=132, lines=50)")
    term.stdin(f"raise SystemExit({exit_code})\n")
    assert term.until_end() == {"type": "exit", "code": exit_code}
