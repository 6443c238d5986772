"""``orchard bench files``: latency of file calls against a command's, in one sandbox.

File calls run inside the sandbox (one helper process each, like a command), so their
cost sits next to ``exec true``'s; this is the figure a persistent spawner would cut.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable

from orchard.bench.measure import percentile
from orchard.client.aio import AsyncClient, AsyncSandbox


async def _time(call: Callable[[], Awaitable[object]], samples: int) -> dict[str, float]:
    await call()  # warm
    took = []
    for _ in range(samples):
        start = time.perf_counter()
        await call()
        took.append((time.perf_counter() - start) * 1000)
    return {"p50_ms": round(percentile(took, 50), 2), "p99_ms": round(percentile(took, 99), 2)}


async def run(client: AsyncClient, samples: int, size: int) -> dict:
    sandbox: AsyncSandbox = await client.create("host")
    try:
        payload = b"x" * size
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            f"upload {size} B": lambda: sandbox.upload("bench.bin", payload),
            f"download {size} B": lambda: sandbox.download("bench.bin"),
            "list": lambda: sandbox.list_files("."),
            "exec true": lambda: sandbox.exec("true"),
        }
        return {"samples": samples, **{name: await _time(call, samples) for name, call in calls.items()}}
    finally:
        await sandbox.delete()
