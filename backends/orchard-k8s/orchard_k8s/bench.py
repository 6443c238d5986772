"""``orchard bench k8s``: N sandbox life cycles through a real ``orchard serve --backend k8s``.

Each sandbox is created (the answer comes once its pod is ready and its agent answered),
runs one command (straight to the pod, never through the API server) and is deleted; at
most ``concurrency`` are alive at once. Reports create-to-ready percentiles and the API
requests the backend made per life cycle (its own count, from ``/resources``; the shared
watch apart), over every life cycle tried: a create that fails costs its calls too. Against the Pod-API test double the double's own count is added by the
caller (``cli.py``): it sees every request, whoever makes it.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from orchard.bench.measure import percentile
from orchard.bench.serve_process import ServeProcess


async def _life_cycle(http: httpx.AsyncClient, body: dict[str, Any]) -> float:
    """Create (timed: the answer is the ready sandbox), one command, delete."""
    start = time.perf_counter()
    created = await http.post("/sandboxes", json=body)
    took = time.perf_counter() - start
    if created.status_code != 200 or created.json().get("status") != "ready":
        raise RuntimeError(f"create {body['sandbox_id']}: {created.status_code} {created.text[:300]}")
    try:
        ran = await http.post(f"/sandboxes/{body['sandbox_id']}/exec", json={"command": "true", "wait": True})
        if ran.status_code != 200 or ran.json().get("exit_code") != 0:
            raise RuntimeError(f"exec {body['sandbox_id']}: {ran.status_code} {ran.text[:300]}")
    finally:
        deleted = await http.delete(f"/sandboxes/{body['sandbox_id']}")
        if deleted.status_code not in (200, 204):
            raise RuntimeError(f"delete {body['sandbox_id']}: {deleted.status_code} {deleted.text[:300]}")
    return took


async def measure(settings: dict[str, Any], image: str, sandboxes: int, concurrency: int,
                  memory: str = "128Mi") -> dict[str, Any]:
    """Run the life cycles; the backend's API counts are read before and after."""
    directory = Path(tempfile.mkdtemp(prefix="orchard-bench-k8s-"))
    server = ServeProcess({"name": "k8s", "settings": settings}, directory)
    run = secrets.token_hex(3)
    latencies: list[float] = []
    failures: list[str] = []
    try:
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        async with httpx.AsyncClient(base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=600,
                                     limits=limits) as http:
            await server.wait_ready()
            before = (await http.get("/resources")).json()["capacity"]  # connects, starts the watch
            gate = asyncio.Semaphore(concurrency)

            async def one(index: int) -> None:
                body = {"image": image, "sandbox_id": f"bench-{run}-{index}", "cpu": "1", "memory": memory,
                        "timeout": 300}
                async with gate:
                    try:
                        latencies.append(await _life_cycle(http, body))
                    except Exception as exc:  # counted and shown, never hidden
                        failures.append(f"{type(exc).__name__}: {exc}")

            start = time.perf_counter()
            await asyncio.gather(*(one(index) for index in range(sandboxes)))
            wall = time.perf_counter() - start
            after = (await http.get("/resources")).json()["capacity"]
    finally:
        server.stop()
    done = len(latencies)
    calls = after["api_calls"] - before["api_calls"]
    return {"sandboxes": sandboxes, "succeeded": done, "concurrency": concurrency,
            "create_to_ready_p50_ms": round(percentile(latencies, 50) * 1000, 1),
            "create_to_ready_p99_ms": round(percentile(latencies, 99) * 1000, 1),
            "wall_s": round(wall, 1), "life_cycles_per_s": round(done / wall, 2) if wall else 0.0,
            "backend_api_calls": calls, "backend_api_calls_per_life_cycle": round(calls / sandboxes, 3),
            "watch_lists": after["watch_lists"], "failures": failures[:10]}
