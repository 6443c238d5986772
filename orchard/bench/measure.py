"""Small measuring helpers: percentiles, CPU time of a process tree, available memory."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its reaped children (utime+stime+cutime+cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / CLOCK_TICKS


def cpu_seconds_fine(pid: int) -> float:
    """``cpu_seconds`` at nanosecond resolution where the kernel keeps schedstats: the CPU of
    ``pid``'s live threads from ``/proc/PID/task/*/schedstat``, plus its reaped children in
    clock ticks. ``/proc/PID/stat`` counts in 10 ms ticks, too coarse for a chunk of 25
    commands of a millisecond each. (A thread that exits between two readings takes its
    time with it: fine for servers whose threads live as long as they do.)"""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        threads = sum(int((task / "schedstat").read_text().split()[0]) for task in Path(f"/proc/{pid}/task").iterdir())
    except (OSError, ValueError, IndexError):
        return cpu_seconds(pid)
    return threads / 1e9 + sum(int(x) for x in fields[13:15]) / CLOCK_TICKS


def own_cpu_seconds() -> float:
    """CPU of this process (nanoseconds) and of its reaped children (microseconds)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def cpu_probe() -> float:
    """Seconds for a fixed pure-Python loop, ``sum(range(3 * 10**7))``: how fast the machine is
    right now. On a shared VM it moved between 0.42 and 0.63 s within minutes, and every
    figure with it, so benchmarks report it before and after."""
    started = time.perf_counter()
    sum(range(30_000_000))
    return round(time.perf_counter() - started, 3)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def count_processes(needle: str) -> int:
    """Processes whose command line contains ``needle``. A process in the middle of execve
    briefly has an empty command line, so a just-started background command can read as
    absent: callers expecting a process to appear use ``await_processes``."""
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle.encode() in (entry / "cmdline").read_bytes().replace(b"\0", b" "):
                    count += 1
            except OSError:
                pass
    return count


def await_processes(needle: str, at_least: int, timeout: float = 10.0) -> int:
    """``count_processes(needle)`` once it reaches ``at_least``, or its last value at ``timeout``."""
    deadline = time.monotonic() + timeout
    while (count := count_processes(needle)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return count
