"""Python's cyclic garbage collector set for a long-lived service's hot path.

The agent and the server allocate a few thousand tracked objects per command (requests,
futures, coroutines, models), so with CPython's default thresholds (700, 10, 10) the young
generation is collected every few commands and the whole heap (the app, its routes,
pydantic's schemas, every sandbox's state: hundreds of thousands of objects) now and then.
Under 100 sandboxes' load py-spy put 12% of the agent's CPU in ``gc_collect_main``.

What exists once the service has started lives as long as the process, so it is frozen:
the collector never walks it again (reference counting still frees any of it that is
dropped; only a garbage *cycle* among frozen objects would stay). The young generation is
collected every ``YOUNG_THRESHOLD`` allocations instead of 700, so up to that many cyclic
garbage objects wait for it instead of 700: memory stays bounded, by a larger bound.
"""

from __future__ import annotations

import gc
from typing import Any

YOUNG_THRESHOLD = 20_000  # net allocations between young collections (CPython's default: 700)


def tune_for_service(young_threshold: int = YOUNG_THRESHOLD) -> None:
    """Freeze what exists now and collect the young generation less often."""
    gc.collect()  # startup's garbage first: a cycle frozen would never be collected
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)


def tune_after_startup(server: Any) -> None:
    """Tune once ``server`` (a ``uvicorn.Server``) has started: after its lifespan built the
    service's long-lived state, so that state is frozen too."""
    original_startup = server.startup

    async def startup(sockets: Any = None) -> None:
        await original_startup(sockets)
        if server.started:
            tune_for_service()

    server.startup = startup
