"""Sync handles on interactive processes and shell sessions: the async ones driven from the
sync client's loop thread (one implementation, see :mod:`orchard.client.sync`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from orchard.client.pty import AsyncPty
from orchard.client.session import AsyncShellSession, SessionResult

if TYPE_CHECKING:
    from orchard.client.sync import Portal


class SyncPty:
    """``write_stdin``, ``read``, ``read_all``, ``kill``, ``resize``, ``wait``, ``close``; ``with`` closes."""

    def __init__(self, portal: "Portal", inner: AsyncPty) -> None:
        self._portal = portal
        self._inner = inner

    @property
    def pid(self) -> int:
        return self._inner.pid

    @property
    def session_id(self) -> Optional[str]:
        return self._inner.session_id

    @property
    def exit_code(self) -> Optional[int]:
        return self._inner.exit_code

    @property
    def done(self) -> bool:
        return self._inner.done

    def __enter__(self) -> "SyncPty":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_stdin(self, data: Union[bytes, str]) -> None:
        self._portal.call(self._inner.write_stdin(data))

    def read(self, timeout: Optional[float] = None) -> bytes:
        return self._portal.call(self._inner.read(timeout))

    def read_all(self, timeout: Optional[float] = None) -> bytes:
        return self._portal.call(self._inner.read_all(timeout))

    def kill(self, sig: str = "KILL") -> None:
        self._portal.call(self._inner.kill(sig))

    def resize(self, rows: int, cols: int) -> None:
        self._portal.call(self._inner.resize(rows, cols))

    def wait(self, timeout: Optional[float] = None) -> int:
        return self._portal.call(self._inner.wait(timeout))

    def close(self) -> None:
        self._portal.call(self._inner.close())


class SyncShellSession:
    """``run(command, timeout)`` in a long-lived bash; ``with`` closes it."""

    def __init__(self, portal: "Portal", inner: AsyncShellSession) -> None:
        self._portal = portal
        self._inner = inner

    def __enter__(self) -> "SyncShellSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, command: str, timeout: Optional[float] = None) -> SessionResult:
        return self._portal.call(self._inner.run(command, timeout))

    def close(self) -> None:
        self._portal.call(self._inner.close())
