"""``orchard bench slurm``: the Slurm backend's figures, measured on a real Slurm.

Four numbers, each from a cold start where it matters: pilot start (submit to the
agent's address in the shared directory), sandbox ready on a warm pilot (per-job mode: a
sandbox's own job, submit to ready), exec round trip to the compute node's agent (the hot
path, per runtime), and N sandboxes end to end
from an empty pool (all created and holding at once, so the pool grows to several pilots;
one command each; all deleted; every pilot gone from squeue).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from orchard.bench.measure import percentile
from orchard.client.aio import AsyncClient
from orchard_slurm import slurm
from orchard_slurm.backend import SlurmBackend


def default_settings(runtime: str) -> dict[str, Any]:
    """Settings for a bench on one machine: a fresh shared directory, loopback agents."""
    shared = Path(tempfile.mkdtemp(prefix="orchard-bench-slurm-", dir="/tmp"))
    shared.chmod(0o755)  # sandbox roots below must be reachable by the sandbox uid
    return {"shared_dir": str(shared), "agent_host": "127.0.0.1", "runtime": runtime, "pilot_idle_seconds": 0,
            "min_remaining_minutes": 0, "time_limit_minutes": 30, "job_name": f"orchard-bench-{os.getpid()}"}


def ms(seconds: list[float], q: float) -> float:
    return round(percentile(seconds, q) * 1000, 2)


async def pilots_gone(backend: SlurmBackend, within: float = 30.0) -> float:
    """Seconds until squeue shows none of this service's pilots (raises after ``within``)."""
    start = time.perf_counter()
    while await slurm.jobs_named(backend.config.job_name, backend.pool.job_comment):
        if time.perf_counter() - start > within:
            raise TimeoutError(f"pilots still in squeue after {within:.0f} s")
        await asyncio.sleep(0.2)
    return round(time.perf_counter() - start, 2)


async def measure(settings: dict[str, Any], image: str, sandboxes: int, samples: int,
                  concurrency: int) -> dict[str, Any]:
    per_job = settings.get("mode") == "per-job"
    result: dict[str, Any] = {"mode": settings.get("mode", "pilot"), "runtime": settings.get("runtime", "bwrap"),
                              "image": image, "sandboxes": sandboxes}
    if per_job:
        settings = {**settings, "max_pilots": max(settings.get("max_pilots", 4), sandboxes + 1)}
    async with AsyncClient(backend="slurm", backend_settings=settings) as client:
        backend: SlurmBackend = client.backend  # type: ignore[assignment]
        if per_job:
            await backend.pool.bundle()  # built once, before the clock starts
        start = time.perf_counter()
        first = await client.create(image)
        result["first_sandbox_cold_s"] = round(time.perf_counter() - start, 3)
        pilot = backend.pool.pilots[backend.pool.owner[first.id]]
        result["pilot_start_s"] = round((pilot.ready_at or 0) - pilot.submitted_at, 3)

        ready: list[float] = []
        for _ in range(min(samples, 10) if per_job else samples):  # pilot mode: `first` keeps its pilot up
            start = time.perf_counter()
            extra = await client.create(image)
            ready.append(time.perf_counter() - start)
            await extra.delete()
        label = "ready_per_job" if per_job else "ready_on_warm_pilot"  # per-job: every create is a new job
        result[f"{label}_p50_ms"], result[f"{label}_p90_ms"] = ms(ready, 50), ms(ready, 90)

        rtt: list[float] = []
        await first.exec("true")
        for _ in range(samples * 4):
            start = time.perf_counter()
            await first.exec("true")
            rtt.append(time.perf_counter() - start)
        result["exec_p50_ms"], result["exec_p99_ms"] = ms(rtt, 50), ms(rtt, 99)
        await first.delete()
        await pilots_gone(backend)

        gate = asyncio.Semaphore(concurrency)
        failures: list[str] = []

        async def one(index: int) -> Any:
            async with gate:
                handle = await client.create(image, sandbox_id=f"bench-{os.getpid()}-{index}")
                job = await handle.exec("echo $((6 * 7))")
                if job.stdout != "42\n":
                    failures.append(f"{handle.id}: {job.exit_code} {job.stderr[-200:]}")
                return handle

        submitted_before = backend.pool.pilots_submitted
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(i) for i in range(sandboxes)), return_exceptions=True)
        result["all_created_and_ran_s"] = round(time.perf_counter() - start, 2)
        result["pilots_used"] = backend.pool.pilots_submitted - submitted_before
        handles = [o for o in outcomes if not isinstance(o, BaseException)]
        await asyncio.gather(*(handle.delete() for handle in handles))
        result["end_to_end_s"] = round(time.perf_counter() - start, 2)
        failures += [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
        result["succeeded"] = sandboxes - len(failures)
        result["pilots_gone_after_s"] = await pilots_gone(backend)
        result["failures"] = failures[:10]
    return result
