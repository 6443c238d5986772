"""The sync Python SDK: the async client driven from a private event-loop thread.

One implementation serves both styles, so they cannot drift apart.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Awaitable, Callable, Iterator, Optional, TypeVar

from orchard.client.aio import DOWNLOAD_LIMIT, AsyncClient, AsyncSandbox, Command
from orchard.client.sync_pty import SyncPty, SyncShellSession
from orchard.models import FileEntry, Job, PatchResult, Sandbox, Snapshot

T = TypeVar("T")
_DONE = object()


class Portal:
    """Runs coroutines on a loop in a daemon thread and hands back their results: how sync
    code (the sync SDK, slime's plain function calls) drives async clients that must outlive
    one call."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="orchard-client", daemon=True)
        self.thread.start()

    def call(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def iterate(self, make_iterator: Callable[[], Any]) -> Iterator[Any]:
        items: "queue.Queue[Any]" = queue.Queue(maxsize=256)

        async def pump() -> None:
            try:
                async for item in make_iterator():
                    await asyncio.to_thread(items.put, item)
            except BaseException as exc:  # re-raised in the caller's thread
                await asyncio.to_thread(items.put, exc)
            await asyncio.to_thread(items.put, _DONE)

        asyncio.run_coroutine_threadsafe(pump(), self.loop)
        while True:
            item = items.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


class SyncSandbox:
    """A sync handle on one sandbox; ``with`` deletes it on the way out."""

    def __init__(self, portal: Portal, inner: AsyncSandbox) -> None:
        self._portal = portal
        self._inner = inner

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def info(self) -> Sandbox:
        return self._inner.info

    def __repr__(self) -> str:
        return repr(self._inner).replace("AsyncSandbox", "Sandbox")

    def __enter__(self) -> "SyncSandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def exec(self, command: Command, **options: Any) -> Any:
        """Run a command; options as :meth:`AsyncSandbox.exec` (timeout, cwd, env, check, ...);
        ``pty=True`` returns a :class:`SyncPty`."""
        result = self._portal.call(self._inner.exec(command, **options))
        return SyncPty(self._portal, result) if options.get("pty") else result

    def pty(self, cmd: Optional[list[str]] = None, **options: Any) -> SyncPty:
        """An interactive process on a terminal; options as :meth:`AsyncSandbox.pty`."""
        return SyncPty(self._portal, self._portal.call(self._inner.pty(cmd, **options)))

    def session(self, **options: Any) -> SyncShellSession:
        """A persistent bash whose cwd, environment and functions persist between ``run`` calls."""
        return SyncShellSession(self._portal, self._portal.call(self._inner.session(**options)))

    def submit(self, command: Command, **options: Any) -> str:
        return self._portal.call(self._inner.submit(command, **options))

    def job(self, job_id: str) -> Job:
        return self._portal.call(self._inner.job(job_id))

    def wait_job(self, job_id: str, timeout: float = 30.0) -> Job:
        return self._portal.call(self._inner.wait_job(job_id, timeout))

    def exec_stream(self, command: Command, **options: Any) -> Iterator[dict]:
        return self._portal.iterate(lambda: self._inner.exec_stream(command, **options))

    def upload(self, path: str, data: bytes | str, mode: Optional[int] = None) -> int:
        return self._portal.call(self._inner.upload(path, data, mode))

    def download(self, path: str, max_bytes: Optional[int] = DOWNLOAD_LIMIT) -> bytes:
        return self._portal.call(self._inner.download(path, max_bytes))

    def list_files(self, path: str = ".") -> list[FileEntry]:
        return self._portal.call(self._inner.list_files(path))

    def apply_patch(self, patch: str, timeout: Optional[float] = None) -> PatchResult:
        return self._portal.call(self._inner.apply_patch(patch, timeout))

    def heartbeat(self) -> Sandbox:
        return self._portal.call(self._inner.heartbeat())

    def start_heartbeats(self, interval: float = 30.0) -> None:
        self._portal.loop.call_soon_threadsafe(self._inner.start_heartbeats, interval)

    def refresh(self) -> Sandbox:
        return self._portal.call(self._inner.refresh())

    def snapshot(self, snapshot_id: Optional[str] = None) -> Snapshot:
        return self._portal.call(self._inner.snapshot(snapshot_id))

    def reset(self) -> Sandbox:
        return self._portal.call(self._inner.reset())

    def delete(self) -> None:
        self._portal.call(self._inner.delete())


class Client:
    """Sync client: ``Client()`` runs the local backend in process; ``Client(url, api_key)``
    talks to a server. ``with Client() as c, c.create() as sandbox: sandbox.exec("ls")``."""

    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, **options: Any) -> None:
        self._portal = Portal()

        async def build() -> AsyncClient:
            return AsyncClient(url, api_key, **options)

        try:
            self._inner = self._portal.call(build())
        except BaseException:
            self._portal.close()
            raise

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._portal.call(self._inner.close())
        finally:
            self._portal.close()

    def create(self, image: str = "host", **spec: Any) -> SyncSandbox:
        return SyncSandbox(self._portal, self._portal.call(self._inner.create(image, **spec)))

    def get(self, sandbox_id: str) -> SyncSandbox:
        return SyncSandbox(self._portal, self._portal.call(self._inner.get(sandbox_id)))

    def list(self) -> list[Sandbox]:
        return self._portal.call(self._inner.list())

    def fork(self, snapshot: Snapshot | str, n: int = 1, **spec: Any) -> list[SyncSandbox]:
        return [SyncSandbox(self._portal, inner) for inner in self._portal.call(self._inner.fork(snapshot, n, **spec))]

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return self._portal.call(self._inner.get_snapshot(snapshot_id))

    def list_snapshots(self) -> list[Snapshot]:
        return self._portal.call(self._inner.list_snapshots())

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._portal.call(self._inner.delete_snapshot(snapshot_id))

    def delete(self, sandbox_id: str) -> None:
        self._portal.call(self._inner.delete(sandbox_id))

    def resources(self) -> dict:
        return self._portal.call(self._inner.resources())
