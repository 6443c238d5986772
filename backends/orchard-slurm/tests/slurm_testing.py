"""Helpers of the Slurm backend's tests (the dev cluster's job queue, per-test settings,
clients and scenarios that must leave no job behind)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import pytest

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
    settings = {"shared_dir": str(shared), "image_dirs": [str(shared)], "registries": ["127.0.0.1", "localhost"],
                "agent_host": "127.0.0.1", "time_limit_minutes": 10, "host_id_count": 4 * 65536,
                "min_remaining_minutes": 0, "job_name": f"orchard-test-{os.getpid()}-{time.monotonic_ns() % 10**6}"}
    return {**settings, **overrides}


def run_leaving_no_jobs(job_name: str, scenario: Callable[[], Awaitable[None]], check: bool = True) -> None:
    """Run ``scenario``; then no job of ``job_name`` may be left (they are cancelled regardless)."""
    try:
        asyncio.run(scenario())
        if check:
            assert wait_until_no_jobs(job_name) == []
    finally:
        subprocess.run(["scancel", "-n", job_name], check=False)


@contextlib.contextmanager
def slurm_client(settings: dict[str, Any]) -> Iterator[Any]:
    """An in-process SDK client on the slurm backend; its pilots must be gone once it closes."""
    from orchard.client import Client

    client = Client(backend="slurm", backend_settings=settings)
    try:
        yield client
    finally:
        client.close()
    assert wait_until_no_jobs(settings["job_name"]) == []


def require(runtime: type) -> None:
    """Fail (never skip) when a runtime's tools are missing: make system-deps installs them."""
    reason = runtime.unavailable_reason()
    if reason:
        pytest.fail(f"{runtime.name} cannot run here: {reason}")


def lost_soon(client: Any, sandbox_id: str, seconds: float = 30) -> bool:
    """Whether the sandbox reads ``lost`` within ``seconds``. While its agent is dead but its
    job has not yet ended, the status is unknown: the call says AgentUnreachable (retryable)."""
    from orchard.errors import AgentUnreachable

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if client.get(sandbox_id).info.status == "lost":
                return True
        except AgentUnreachable:
            pass
        time.sleep(0.2)
    return False


def busybox_probe(address: str, port: int = 8080) -> str:
    """A command for busybox images: what ``address:port`` answers, or "refused"."""
    return f"nc -w 3 {address} {port} </dev/null 2>/dev/null || echo refused"
