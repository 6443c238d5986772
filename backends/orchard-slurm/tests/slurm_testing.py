"""Helpers of the Slurm backend's tests (the dev cluster's job queue, per-test settings)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # the repository's own test helpers (tests.images: a real registry)


def squeue_jobs(name: str) -> list[str]:
    """Live jobs with this name (ending ones, COMPLETING, excluded)."""
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip() and "COMPLETING" not in line]


def wait_until_no_jobs(name: str, seconds: float = 20) -> list[str]:
    deadline = time.monotonic() + seconds
    while (jobs := squeue_jobs(name)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return jobs


def slurm_settings(**overrides: Any) -> dict[str, Any]:
    """A fresh shared directory (reachable by the sandbox uid) and a unique job name."""
    shared = Path(tempfile.mkdtemp(prefix="orchard-slurm-test-", dir="/tmp"))
    shared.chmod(0o755)
    settings = {"shared_dir": str(shared), "agent_host": "127.0.0.1", "time_limit_minutes": 10,
                "min_remaining_minutes": 0, "job_name": f"orchard-test-{os.getpid()}-{time.monotonic_ns() % 10**6}"}
    return {**settings, **overrides}
