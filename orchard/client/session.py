"""Persistent shell sessions on an interactive process: one long-lived bash where the
working directory, environment and functions persist between ``run`` calls.

End of command: after each command the shell prints a marker holding a fresh random nonce
and the exit status (built by ``printf`` from pieces, so neither the command's text nor the
terminal's echo contain it). Output that looks like a marker but carries another nonce is
just output. The terminal is put in raw mode with echo off (no CRLF, no 4 KiB line limit,
no echo), history is off (the nonce is not in ``history``), job control is off.
A timeout interrupts the command (INT, then TERM, which an interactive bash ignores
itself), resynchronises on a new marker and leaves the session usable.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass
from typing import Optional

from orchard.client.pty import AsyncPty
from orchard.errors import OrchardError

SETUP = ("stty raw -echo 2>/dev/null; set +o history +m; unset HISTFILE PROMPT_COMMAND; PS1=''; PS2=''; "
         "export PAGER=cat GIT_PAGER=cat")
MARKER = "printf '\\n__ORCHARD_%s_%s__\\n' {nonce} $?"
INTERRUPT_GRACE = 2.0
TIMEOUT_EXIT_CODE = 124


class SessionDied(OrchardError):
    """The session's shell is gone (it exited, was killed, or its sandbox ended)."""

    status_code = 410
    error_type = "sandbox_lost"


@dataclass
class SessionResult:
    exit_code: int
    output: str
    timed_out: bool = False
    truncated: bool = False


def _quote(command: str) -> str:
    return "'" + command.replace("'", "'\\''") + "'"


class AsyncShellSession:
    def __init__(self, pty: AsyncPty, max_output_bytes: int = 1 << 20) -> None:
        self.pty = pty
        self.max_output_bytes = max_output_bytes
        self._buffer = bytearray()
        self._truncated = False

    @classmethod
    async def start(cls, sandbox: object, *, env: Optional[dict[str, str]] = None, cwd: Optional[str] = None,
                    max_output_bytes: int = 1 << 20, timeout: float = 30.0) -> "AsyncShellSession":
        pty = await sandbox.pty(["bash", "--norc", "--noprofile"], env={"TERM": "dumb", **(env or {})},  # type: ignore[attr-defined]
                                cwd=cwd, rows=50, cols=200)
        session = cls(pty, max_output_bytes)
        nonce = secrets.token_hex(12)
        await pty.write_stdin(f"{SETUP}; {MARKER.format(nonce=nonce)}\n")
        try:
            await session._until(re.compile(f"__ORCHARD_{nonce}_\\d+__\n".encode()), timeout)
        except BaseException:
            await pty.close()
            raise
        session._buffer.clear()
        return session

    async def _until(self, pattern: "re.Pattern[bytes]", timeout: Optional[float]) -> Optional["re.Match[bytes]"]:
        """Read until ``pattern`` is in the buffer (None when ``timeout`` passed first)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        searched = 0
        while True:
            found = pattern.search(self._buffer, max(0, searched - 128))
            if found:
                return found
            searched = len(self._buffer)
            if self.pty.done:
                raise SessionDied(f"the session's shell ended ({self.pty.error or f'exit {self.pty.exit_code}'})")
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return None
            chunk = await self.pty.read(left)
            self._buffer += chunk
            if len(self._buffer) > 2 * self.max_output_bytes:  # keep the head and the recent tail
                head = self.max_output_bytes // 2
                del self._buffer[head:len(self._buffer) - self.max_output_bytes // 2]
                self._truncated = True
                searched = head

    async def run(self, command: str, timeout: Optional[float] = None) -> SessionResult:
        """Run ``command`` in the session's shell; exit code 124 and ``timed_out`` when it
        was interrupted after ``timeout`` seconds."""
        self._buffer.clear()
        self._truncated = False
        nonce = secrets.token_hex(12)
        await self.pty.write_stdin(f"eval {_quote(command)}; {MARKER.format(nonce=nonce)}\n")
        pattern = re.compile(f"\n__ORCHARD_{nonce}_(\\d+)__\n".encode())
        found = await self._until(pattern, timeout)
        if found is not None:
            return self._result(found, int(found.group(1)))
        return await self._interrupt(timeout)

    async def _interrupt(self, timeout: Optional[float]) -> SessionResult:
        for sig in ("INT", "TERM"):
            # a marker of its own each time: the one written after INT, if it runs only after
            # TERM, comes before this one and is cut, never left for the next command
            resync = secrets.token_hex(12)
            pattern = re.compile(f"\n__ORCHARD_{resync}_\\d+__\n".encode())
            await self.pty.kill(sig)
            await self.pty.write_stdin(f"\n{MARKER.format(nonce=resync)}\n")
            found = await self._until(pattern, INTERRUPT_GRACE)
            if found is not None:
                output = self._buffer[:found.start()]
                cut = re.search(b"\n__ORCHARD_[0-9a-f]{24}_\\d+__\n", output)
                text = bytes(output[:cut.start()] if cut else output).decode(errors="replace")
                self._buffer.clear()
                return SessionResult(TIMEOUT_EXIT_CODE, text, timed_out=True, truncated=self._truncated)
        await self.pty.close()
        raise SessionDied(f"the command ignored INT and TERM after its {timeout}s timeout; the session was closed")

    def _result(self, found: "re.Match[bytes]", code: int) -> SessionResult:
        text = bytes(self._buffer[:found.start()]).decode(errors="replace")
        del self._buffer[:found.end()]
        return SessionResult(code, text, truncated=self._truncated)

    async def close(self) -> None:
        await self.pty.close()

    async def __aenter__(self) -> "AsyncShellSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
