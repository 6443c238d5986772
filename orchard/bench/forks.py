"""``orchard bench forks``: a prepared sandbox forked versus a fresh sandbox plus setup.

GRPO runs G rollouts of a task from one starting state. Without snapshots every rollout
pays for a fresh sandbox and the task's setup; with them the setup runs once and each
rollout's sandbox is a copy-on-write fork. Both are measured in one run, on one machine.
"""

from __future__ import annotations

import time
from typing import Any

from orchard.bench.measure import percentile
from orchard.client.aio import AsyncClient

# A small repository made and committed, as a task's setup would (200 files, one commit).
DEFAULT_SETUP = ("mkdir -p /workspace/repo && cd /workspace/repo && git init -q && "
                 "for i in $(seq 200); do printf 'def f%s():\\n    return %s\\n' $i $i > m$i.py; done && "
                 "git add -A && git -c user.email=bench@orchard -c user.name=bench commit -qm setup")
CHECK = "test -f /workspace/repo/m200.py"


def _ms(values: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 50) * 1000, 1), "p90": round(percentile(values, 90) * 1000, 1),
            "max": round(max(values) * 1000, 1)}


async def run(client: AsyncClient, image: str, setup: str, samples: int, forks: int) -> dict[str, Any]:
    warm = await client.create(image)  # the image is unpacked once, before anything is timed
    await warm.delete()
    fresh: list[float] = []
    for _ in range(samples):
        start = time.perf_counter()
        sandbox = await client.create(image)
        await sandbox.exec(setup, check=True, timeout=300)
        fresh.append(time.perf_counter() - start)
        await sandbox.delete()
    prepared = await client.create(image)
    try:
        await prepared.exec(setup, check=True, timeout=300)
        start = time.perf_counter()
        snapshot = await prepared.snapshot()
        snapshot_seconds = time.perf_counter() - start
        single: list[float] = []
        for _ in range(samples):
            start = time.perf_counter()
            [fork] = await client.fork(snapshot)
            single.append(time.perf_counter() - start)
            await fork.exec(CHECK, check=True)
            await fork.delete()
        start = time.perf_counter()
        group = await client.fork(snapshot, forks)
        group_seconds = time.perf_counter() - start
        try:
            for fork in group:
                await fork.exec(CHECK, check=True)
        finally:
            for fork in group:
                await fork.delete()
        await client.delete_snapshot(snapshot.snapshot_id)
    finally:
        await prepared.delete()
    return {"image": image, "samples": samples, "fresh_sandbox_plus_setup_ms": _ms(fresh),
            "snapshot_ms": round(snapshot_seconds * 1000, 1), "fork_ready_ms": _ms(single),
            "speedup_p50": round(percentile(fresh, 50) / max(percentile(single, 50), 1e-9), 1),
            "forks": forks, "forks_ready_seconds": round(group_seconds, 3), "snapshot_bytes": snapshot.size_bytes}
