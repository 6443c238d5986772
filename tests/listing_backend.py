"""A stand-in backend for reconciler tests: it lists what it was given and records deletes.
The reconciler's logic is under test, not a backend's; the hooks let a test interleave
another replica's work at the awaits a real backend call would yield at."""

from __future__ import annotations

from typing import Awaitable, Callable, Optional

from orchard.models import Sandbox

Hook = Optional[Callable[[str], Awaitable[None]]]


class ListingBackend:
    name = "fake"

    def __init__(self) -> None:
        self.live: dict[str, Sandbox] = {}
        self.deleted: list[str] = []
        self.during_list: Optional[Callable[[], Awaitable[None]]] = None
        self.during_delete: Hook = None

    async def maintain(self) -> None:
        return None

    async def list(self) -> list[Sandbox]:
        listed = list(self.live.values())
        if self.during_list is not None:
            await self.during_list()
        return listed

    async def delete(self, sandbox_id: str) -> None:
        if self.during_delete is not None:
            hook, self.during_delete = self.during_delete, None  # once: the other replica's delete runs plainly
            await hook(sandbox_id)
        self.deleted.append(sandbox_id)
        self.live.pop(sandbox_id, None)
