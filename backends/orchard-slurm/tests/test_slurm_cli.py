"""``orchard slurm pilots`` and ``orchard slurm cancel-all`` as a user runs them, against a
service's pilots on the dev cluster (one adopted, one orphaned)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from orchard.models import SandboxSpec
from orchard_slurm.backend import SlurmBackend
from slurm_testing import slurm_settings, squeue_jobs, wait_until_no_jobs


def orchard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchard.cli", *args], capture_output=True, text=True, timeout=60)


def test_pilots_lists_known_and_orphaned_jobs_and_cancel_all_ends_them(slurm_cluster):
    settings = slurm_settings(sandboxes_per_pilot=1, max_pilots=2, pilot_idle_seconds=600)
    config = Path(settings["shared_dir"]) / "orchard.yaml"
    config.write_text(yaml.safe_dump({"backend": {"name": "slurm", "settings": settings}}))

    async def two_pilots() -> list[str]:
        backend = SlurmBackend.from_settings(settings)
        sandboxes = [await backend.create(SandboxSpec()) for _ in range(2)]
        pilots = [backend.pool.pilots[backend.pool.owner[s.sandbox_id]] for s in sandboxes]
        for pilot in pilots:
            await pilot.api.close()  # the service goes away, its pilots stay
        shutil.rmtree(pilots[1].directory)  # and one pilot's record is lost: an orphan
        return [pilot.job_id for pilot in pilots]

    try:
        kept, orphan = asyncio.run(two_pilots())
        listed = orchard("slurm", "pilots", "--config", str(config), "--json")
        assert listed.returncode == 0, listed.stderr
        rows = {row["job_id"]: row for row in json.loads(listed.stdout)}
        assert set(rows) == {kept, orphan}
        assert rows[kept]["pilot"] and rows[kept]["sandboxes"] == 1 and rows[kept]["address"].startswith("http://")
        assert rows[orphan]["pilot"] is None and rows[orphan]["state"] == "RUNNING"
        assert "orphan" in orchard("slurm", "pilots", "--config", str(config)).stdout

        refused = orchard("slurm", "cancel-all", "--config", str(config))  # asks first; no answer: nothing
        assert refused.returncode != 0 and len(squeue_jobs(settings["job_name"])) == 2
        cancelled = orchard("slurm", "cancel-all", "--config", str(config), "--yes")
        assert cancelled.returncode == 0 and "cancelled 2 job(s)" in cancelled.stdout
        assert wait_until_no_jobs(settings["job_name"]) == []
    finally:
        subprocess.run(["scancel", "-n", settings["job_name"]], check=False)
