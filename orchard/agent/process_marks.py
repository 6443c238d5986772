"""A command's processes found without a cgroup (the direct runtime in a pod or a per-job
container, Podman sandboxes): every command carries ``ORCHARD_JOB=<mark>`` in its
environment, inherited by whatever it starts, so a timeout can kill what left its process
group too; the way CI servers find a build's leftovers. The mark is a fresh random token
per run (never the job id, which a client chooses and may reuse), and each process is
pinned with a pidfd before its environment is read and signalled through that pidfd, so a
PID reused meanwhile is never hit. A process that scrubs its environment escapes this;
where that matters, the sandbox's cgroup is the boundary."""

from __future__ import annotations

import os
import secrets
import signal

MARK = "ORCHARD_JOB"
MAX_ENVIRON = 1 << 20  # read at most this much of each process's environment


def new_mark() -> str:
    return secrets.token_hex(16)


def kill_marked(mark: str) -> int:
    """SIGKILL every process whose environment carries ``mark``; returns how many were signalled."""
    needle = f"{MARK}={mark}".encode()
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            pidfd = os.pidfd_open(int(entry.name))
        except OSError:
            continue  # gone already
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as environ:
                carries = needle in environ.read(MAX_ENVIRON).split(b"\0")
            if carries:  # the pidfd still names the process whose environment we just read
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                count += 1
        except OSError:
            pass  # gone, or not ours to read or signal
        finally:
            os.close(pidfd)
    return count
