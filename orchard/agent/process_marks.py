"""A command's processes found without a cgroup (the direct runtime in a pod or a per-job
container, Podman sandboxes): every command carries ``ORCHARD_JOB=<job id>`` in its
environment, inherited by whatever it starts, so a timeout can kill what left its process
group too; the way CI servers find a build's leftovers. A process that scrubs its
environment escapes this; where that matters, the sandbox's cgroup is the boundary."""

from __future__ import annotations

import os
import signal

MARK = "ORCHARD_JOB"
MAX_ENVIRON = 1 << 20  # read at most this much of each process's environment


def marked(job_id: str) -> list[int]:
    """Processes whose environment carries this job's mark (those we may read)."""
    needle = f"{MARK}={job_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as environ:
                if needle in environ.read(MAX_ENVIRON).split(b"\0"):  # a hostile environment can be huge
                    found.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


def kill_marked(job_id: str) -> int:
    """SIGKILL every process of this job; returns how many were signalled."""
    count = 0
    for pid in marked(job_id):
        try:
            os.kill(pid, signal.SIGKILL)
            count += 1
        except OSError:
            continue
    return count
