"""Load through a real `orchard serve`: N sandboxes x M commands from C concurrent callers,
every result checked (its own output, exactly once), latency percentiles and the peak
memory of the server and the agent reported."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import httpx


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


@dataclass
class LoadReport:
    sandboxes: int
    commands: int
    concurrency: int
    latencies: list[float] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # lost, duplicated or someone else's output
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        ms = [1000 * s for s in self.latencies]
        return {"sandboxes": self.sandboxes, "commands_each": self.commands, "concurrency": self.concurrency,
                "results": len(self.latencies), "wrong": len(self.wrong), "errors": len(self.errors),
                "seconds": round(self.seconds, 2), "commands_per_s": round(len(ms) / self.seconds, 1),
                "p50_ms": round(statistics.median(ms), 2), "p90_ms": round(percentile(ms, 0.9), 2),
                "p99_ms": round(percentile(ms, 0.99), 2), "max_ms": round(max(ms), 2),
                "peak_rss_mb": {k: round(v / 2**20, 1) for k, v in self.peak_rss.items()}}


async def run_load(url: str, api_key: str, sandboxes: int, commands: int, concurrency: int,
                   pids: dict[str, int]) -> LoadReport:
    report = LoadReport(sandboxes, commands, concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": api_key}, timeout=300, limits=limits) as http:
        gate = asyncio.Semaphore(min(concurrency, 32))  # creates: the agent builds sandboxes a few at a time anyway

        async def create(n: int) -> str:
            async with gate:
                answer = await http.post("/sandboxes", json={"sandbox_id": f"load-{n}"})
            answer.raise_for_status()
            return answer.json()["sandbox_id"]

        ids = await asyncio.gather(*(create(n) for n in range(sandboxes)))
        work: asyncio.Queue = asyncio.Queue()
        for i in range(commands):  # round robin: every sandbox has callers waiting on its lock
            for sid in ids:
                work.put_nowait((sid, i))
        stop = asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                for name, pid in pids.items():
                    report.peak_rss[name] = max(report.peak_rss.get(name, 0), rss_bytes(pid))
                try:
                    await asyncio.wait_for(stop.wait(), 0.2)
                except asyncio.TimeoutError:
                    pass

        async def caller() -> None:
            while True:
                try:
                    sid, i = work.get_nowait()
                except asyncio.QueueEmpty:
                    return
                command = f"echo {i} >> /tmp/ran; echo {sid}:{i}"
                start = time.perf_counter()
                try:
                    answer = await http.post(f"/sandboxes/{sid}/exec",
                                             json={"command": command, "wait": True, "job_id": f"{sid}-{i}"})
                except httpx.HTTPError as exc:
                    report.errors.append(f"{sid}:{i}: {type(exc).__name__}: {exc}")
                    continue
                report.latencies.append(time.perf_counter() - start)
                job = answer.json() if answer.status_code == 200 else {}
                if job.get("stdout") != f"{sid}:{i}\n" or job.get("exit_code") != 0:
                    report.wrong.append(f"{sid}:{i}: HTTP {answer.status_code} {answer.text[:200]}")

        sampler = asyncio.create_task(sample())
        began = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        report.seconds = time.perf_counter() - began
        stop.set()
        await sampler

        async def audit(sid: str) -> None:
            """Each command ran exactly once, and the server's records say so too."""
            async with gate:
                ran = await http.post(f"/sandboxes/{sid}/exec", json={"command": "sort -n /tmp/ran", "wait": True})
                if ran.json()["stdout"] != "".join(f"{i}\n" for i in range(commands)):
                    report.wrong.append(f"{sid}: ran {ran.json()['stdout']!r}")
                for i in range(commands):
                    job = (await http.get(f"/jobs/{sid}-{i}")).json()
                    if job.get("stdout") != f"{sid}:{i}\n":
                        report.wrong.append(f"{sid}-{i}: stored {json.dumps(job)[:200]}")
                await http.delete(f"/sandboxes/{sid}")

        await asyncio.gather(*(audit(sid) for sid in ids))
    return report


def agent_pid(agent_state: str) -> int:
    with open(os.path.join(agent_state, "agent", "agent.json")) as info:
        return int(json.load(info)["pid"])
