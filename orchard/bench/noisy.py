"""``orchard bench noisy``: do quiet sandboxes stay fast while neighbours misbehave?

One sandbox floods its stdout (1 GB by default), another uploads a large file (100 MB),
and meanwhile one caller runs ``true`` in the quiet sandboxes in turn. Reports the
quiet sandboxes' exec p50/p99 against a baseline measured before the noise.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from orchard.bench.measure import percentile
from orchard.client.aio import AsyncClient, AsyncSandbox

PAUSE_SECONDS = 0.005  # between probes: the probe must not be the load


async def _probe(sandboxes: list[AsyncSandbox], until: asyncio.Event, samples: list[float]) -> None:
    """One caller visiting the quiet sandboxes in turn: what a victim sees, without the
    probe's own calls queueing behind each other on two cores."""
    turn = 0
    while not until.is_set():
        start = time.perf_counter()
        await sandboxes[turn % len(sandboxes)].exec("true")
        samples.append(time.perf_counter() - start)
        turn += 1
        await asyncio.sleep(PAUSE_SECONDS)


async def run(client: AsyncClient, quiet: int, flood_bytes: int, upload_bytes: int, rounds: int) -> dict[str, Any]:
    quiet_boxes = [await client.create() for _ in range(quiet)]
    flooder, uploader = await client.create(), await client.create()
    try:
        baseline: list[float] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe(quiet_boxes, stop, baseline))
        await asyncio.sleep(2)
        stop.set()
        await probe

        payload = os.urandom(upload_bytes)  # before the probe: it would stall this process's loop
        noisy: list[float] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe(quiet_boxes, stop, noisy))
        start = time.perf_counter()
        for _ in range(rounds):  # repeated, so the p99 rests on more than a handful of samples
            flood, upload = await asyncio.gather(
                flooder.exec(f"head -c {flood_bytes} /dev/zero", timeout=600),
                uploader.upload("big.bin", payload))
        noise_seconds = time.perf_counter() - start
        stop.set()
        await probe
        ms = 1000.0
        return {
            "quiet_sandboxes": quiet, "rounds": rounds, "flood_bytes": flood_bytes, "upload_bytes": upload_bytes,
            "flood_stdout_bytes": flood.stdout_bytes, "flood_truncated": flood.truncated,
            "flood_returned_chars": len(flood.stdout), "upload_size": upload, "noise_seconds": round(noise_seconds, 2),
            "baseline_p50_ms": round(percentile(baseline, 50) * ms, 2),
            "baseline_p99_ms": round(percentile(baseline, 99) * ms, 2),
            "noisy_p50_ms": round(percentile(noisy, 50) * ms, 2), "noisy_p99_ms": round(percentile(noisy, 99) * ms, 2),
            "noisy_samples": len(noisy),
        }
    finally:
        await asyncio.gather(*(s.delete() for s in [*quiet_boxes, flooder, uploader]), return_exceptions=True)
