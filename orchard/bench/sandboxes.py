"""``orchard bench sandboxes``: N sandboxes created concurrently, M commands each, deleted.

Reports create-to-ready and exec round-trip percentiles, commands/s, CPU ms per
command (client + agent + everything the agent spawned), the drop in MemAvailable
while the sandboxes sit idle (so kernel memory counts), and what is left after delete.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchard.bench.measure import count_processes, cpu_probe, cpu_seconds, mem_available, percentile
from orchard.client.aio import AsyncClient, AsyncSandbox


def _agent_pid(client: AsyncClient) -> Optional[int]:
    if client.url is not None:
        return None
    settings = getattr(client.backend.config, "agent", None)
    try:
        return int(json.loads((settings.agent_dir / "agent.json").read_text())["pid"]) if settings else None
    except (OSError, ValueError, KeyError):
        return None


def _leftovers(client: AsyncClient) -> dict[str, int]:
    settings = getattr(getattr(client, "backend", None), "config", None)
    agent = getattr(settings, "agent", None)
    found = {"holder_processes": count_processes("orchard-hold"),
             "sandbox_cgroups": sum(1 for _ in Path("/sys/fs/cgroup").glob("**/orchard/*/*/cgroup.procs"))}
    if agent is not None:
        found["sandbox_dirs"] = sum(1 for _ in agent.sandboxes_dir.iterdir())
        found["mounts"] = sum(1 for line in Path("/proc/self/mounts").read_text().splitlines()
                              if str(agent.sandboxes_dir) in line)
    return found


async def run(client: AsyncClient, sandboxes: int, commands: int, concurrency: int, command: str, image: str,
              latency_samples: int, progress: bool = True) -> dict[str, Any]:
    await client.resources()  # start the agent before the clock starts
    found_before = _leftovers(client)  # what earlier runs or other programs left is not this run's
    probe_before = cpu_probe()
    agent_pid = _agent_pid(client)
    gate = asyncio.Semaphore(concurrency)
    created: list[AsyncSandbox] = []
    create_latency: list[float] = []
    exec_latency: list[float] = []
    failures: list[str] = []
    nonzero = [0]  # commands that ran and exited non-zero: not counted in commands/s
    memory_before = mem_available()
    cpu_before = (cpu_seconds(agent_pid) if agent_pid else 0.0) + time.process_time()

    async def run_command(handle: AsyncSandbox) -> None:
        start = time.perf_counter()
        job = await handle.exec(command)
        exec_latency.append(time.perf_counter() - start)
        if job.exit_code != 0:
            nonzero[0] += 1
            failures.append(f"{handle.id}: exit {job.exit_code} {job.stderr[-200:]}")

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, transient=True) as bar:
        task = bar.add_task("sandboxes", total=sandboxes)

        async def first(index: int) -> None:
            """Phase 1: create, wait for ready, run the first command."""
            async with gate:
                try:
                    start = time.perf_counter()
                    handle = await client.create(image, sandbox_id=f"bench-{os.getpid()}-{index}")
                    create_latency.append(time.perf_counter() - start)
                    created.append(handle)
                    if commands:
                        await run_command(handle)
                except Exception as exc:
                    failures.append(f"sandbox {index}: {type(exc).__name__}: {exc}")
                finally:
                    bar.advance(task)

        wall_start = time.perf_counter()
        await asyncio.gather(*(first(i) for i in range(sandboxes)))
        wall = time.perf_counter() - wall_start

        async def rest(handle: AsyncSandbox) -> None:
            """Phase 2: the other commands, every sandbox busy at once (up to the concurrency)."""
            async with gate:
                for _ in range(commands - 1):
                    try:
                        await run_command(handle)
                    except Exception as exc:
                        failures.append(f"{handle.id}: {type(exc).__name__}: {exc}")

        phase_two = bar.add_task("commands", total=None)
        throughput_start, first_count, first_nonzero = time.perf_counter(), len(exec_latency), nonzero[0]
        await asyncio.gather(*(rest(handle) for handle in created))
        throughput_wall = time.perf_counter() - throughput_start
        bar.remove_task(phase_two)
    cpu_used = (cpu_seconds(agent_pid) if agent_pid else 0.0) + time.process_time() - cpu_before
    memory_idle = memory_before - mem_available()

    latency: list[float] = []
    if created and latency_samples:
        probe = created[0]
        for _ in range(latency_samples):
            start = time.perf_counter()
            await probe.exec(command)
            latency.append(time.perf_counter() - start)

    delete_start = time.perf_counter()
    await asyncio.gather(*(handle.delete() for handle in created), return_exceptions=True)
    delete_wall = time.perf_counter() - delete_start
    remaining = [s for s in await client.list() if s.sandbox_id.startswith(f"bench-{os.getpid()}-")]
    ms = 1000.0
    total_commands = len(exec_latency)
    return {
        "sandboxes": sandboxes, "commands_per_sandbox": commands, "concurrency": concurrency, "image": image,
        "command": command, "mode": (f"{client.url} (direct)" if client.direct else client.url) or "in-process",
        "succeeded": sandboxes - len({f.split(':')[0] for f in failures}), "failures": failures[:20],
        "wall_seconds": round(wall, 3),  # phase 1: all created, ready, and one command run in each
        "create_p50_ms": round(percentile(create_latency, 50) * ms, 2),
        "create_p99_ms": round(percentile(create_latency, 99) * ms, 2),
        "exec_under_load_p50_ms": round(percentile(exec_latency, 50) * ms, 2),
        "exec_under_load_p99_ms": round(percentile(exec_latency, 99) * ms, 2),
        "exec_idle_p50_ms": round(percentile(latency, 50) * ms, 2),
        "exec_idle_p99_ms": round(percentile(latency, 99) * ms, 2),
        "commands_per_second": round((total_commands - first_count - (nonzero[0] - first_nonzero)) / throughput_wall, 1)
        if commands > 1 and throughput_wall else round((total_commands - nonzero[0]) / wall, 1),  # exit 0 only
        "commands_failed": len(failures) - (sandboxes - len(created)),
        "cpu_ms_per_command": round(cpu_used * ms / max(1, total_commands), 2),
        "cpu_ms_per_sandbox_lifecycle": round(cpu_used * ms / max(1, sandboxes), 2),
        "idle_memory_total_mib": round(memory_idle / 2**20, 1),
        "idle_memory_per_sandbox_kib": round(memory_idle / 1024 / max(1, len(created)), 1),
        "delete_wall_seconds": round(delete_wall, 3),
        "leftovers": {"sandboxes": len(remaining),
                      **{name: max(0, count - found_before.get(name, 0)) for name, count in _leftovers(client).items()}},
        "found_before": found_before,
        "cpu_probe_s": {"before": probe_before, "after": cpu_probe()},  # the machine's speed: see measure.cpu_probe
    }
