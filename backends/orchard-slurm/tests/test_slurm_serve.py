"""Acceptance: a real ``orchard serve`` with the Slurm backend on the dev cluster puts 100
sandboxes on pilots, runs a command in each through the server, deletes them, and leaves
nothing in squeue."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from orchard.client.aio import AsyncClient
from slurm_testing import slurm_settings, squeue_jobs, wait_until_no_jobs
from tests.images import free_port  # importable once slurm_testing put the repository on sys.path

SANDBOXES = 100


def start_server(config_path: Path, port: int, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")
    process = subprocess.Popen([sys.executable, "-m", "orchard.cli", "serve", "--config", str(config_path)],
                               stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, f"server exited: {log_path.read_text()[-2000:]}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.05)
    raise AssertionError("server did not start")


def test_orchard_serve_with_slurm_runs_100_sandboxes_and_leaves_nothing_in_squeue(slurm_cluster):
    settings = slurm_settings(sandboxes_per_pilot=32, max_pilots=4, pilot_idle_seconds=0)
    root = Path(settings["shared_dir"])
    port = free_port()
    config = {"port": port, "api_key": "k", "state": str(root / "server.db"), "log_level": "warning",
              "backend": {"name": "slurm", "settings": settings}}
    (root / "orchard.yaml").write_text(yaml.safe_dump(config))
    server = start_server(root / "orchard.yaml", port, root / "server.log")

    async def scenario() -> None:
        async with AsyncClient(f"http://127.0.0.1:{port}", "k") as client:
            gate = asyncio.Semaphore(32)

            async def one(index: int):
                async with gate:
                    handle = await client.create(sandbox_id=f"accept-{index}")
                    job = await handle.exec("echo $(hostname) $((index * 2))".replace("index", str(index)))
                    assert job.stdout == f"accept-{index} {index * 2}\n", job
                    return handle

            handles = await asyncio.gather(*(one(i) for i in range(SANDBOXES)))
            resources = await client.resources()
            assert resources["backend"] == "slurm" and resources["sandboxes"] == {"ready": SANDBOXES}
            assert resources["capacity"]["sandboxes"] == SANDBOXES and resources["capacity"]["pilots"] == 4
            assert len(await client.list()) == SANDBOXES
            await asyncio.gather(*(handle.delete() for handle in handles))
            assert await client.list() == []

    try:
        asyncio.run(scenario())
        assert wait_until_no_jobs(settings["job_name"]) == []  # idle pilots cancelled, no server stop needed
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        leftover = squeue_jobs(settings["job_name"])
        subprocess.run(["scancel", "-n", settings["job_name"]], check=False)
    assert leftover == []
