"""``orchard bench session``: the round trip of one command in a persistent shell session
(SDK -> WebSocket -> agent -> terminal -> bash -> marker -> back), the figure SWE-ReX's bash
session is compared on (113 ms p50 here)."""

from __future__ import annotations

import time
from typing import Any

from orchard.bench.measure import percentile


async def run(client: Any, image: str, samples: int, command: str) -> dict:
    sandbox = await client.create(image)
    try:
        session = await sandbox.session()
        try:
            for _ in range(min(50, samples)):
                await session.run(command)  # warm-up
            latencies = []
            for _ in range(samples):
                started = time.perf_counter()
                result = await session.run(command)
                latencies.append((time.perf_counter() - started) * 1000)
                if result.exit_code != 0:
                    raise RuntimeError(f"{command!r} failed in the session: {result.output[-500:]}")
        finally:
            await session.close()
    finally:
        await sandbox.delete()
    return {"samples": samples, "command": command, "image": image,
            "p50_ms": round(percentile(latencies, 50), 3), "p90_ms": round(percentile(latencies, 90), 3),
            "p99_ms": round(percentile(latencies, 99), 3), "max_ms": round(max(latencies), 3),
            "target_p50_ms": 10.0, "met": percentile(latencies, 50) <= 10.0}
