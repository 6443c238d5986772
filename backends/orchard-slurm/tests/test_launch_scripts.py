"""slurm/orchard-serve.sbatch and slurm/orchard-train.sbatch on the dev cluster: the service
runs as a Slurm job and submits its own pilots, a trainer job finds it through the shared
directory and uses a sandbox, and scancel of the service stops it cleanly."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

from slurm_testing import REPO, slurm_settings, squeue_jobs, wait_until_no_jobs
from tests.images import free_port  # importable once slurm_testing put the repository on sys.path

SMALL = ["--cpus-per-task=1", "--mem=1G", "--time=10"]  # the dev node is 2 CPUs and no GPU
VENV = sys.prefix  # what a site sets as ORCHARD_VENV: the scripts must not depend on the caller's PATH


def sbatch(*args: str) -> str:
    result = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True)
    return result.stdout.strip().split(";")[0]


def test_service_and_trainer_jobs_find_each_other_and_stop_cleanly(slurm_cluster):
    settings = slurm_settings(pilot_idle_seconds=0, sandboxes_per_pilot=4, max_pilots=1)
    shared = Path(settings["shared_dir"])
    config = {"host": "127.0.0.1", "port": free_port(), "api_key": "k", "state": str(shared / "server.db"),
              "log_level": "warning", "backend": {"name": "slurm", "settings": settings}}
    (shared / "orchard.yaml").write_text(yaml.safe_dump(config))
    service_name = settings["job_name"] + "-serve"
    service = sbatch(*SMALL, f"--job-name={service_name}", f"--output={shared}/serve.log",
                     f"--export=ALL,ORCHARD_CONFIG={shared / 'orchard.yaml'},ORCHARD_VENV={VENV}",
                     str(REPO / "slurm/orchard-serve.sbatch"))
    try:
        url_file = shared / "service.url"
        deadline = time.monotonic() + 60
        while not url_file.exists():
            assert time.monotonic() < deadline, f"no service.url:\n{(shared / 'serve.log').read_text()[-2000:]}"
            time.sleep(0.2)
        assert url_file.read_text().strip() == f"http://127.0.0.1:{config['port']}"

        script = ("import os; from orchard.client import Client; "
                  "client = Client(os.environ['ORCHARD_URL'], 'k'); sandbox = client.create(); "
                  "print(sandbox.exec('echo trained-with-$((6*7))').stdout, end=''); sandbox.delete()")
        subprocess.run(["sbatch", "--wait", *SMALL, "--gpus-per-node=0", f"--output={shared}/train.log",
                        f"--export=ALL,ORCHARD_SHARED={shared},ORCHARD_VENV={VENV}", str(REPO / "slurm/orchard-train.sbatch"),
                        "python", "-c", script], check=True, capture_output=True, timeout=120)
        train_log = (shared / "train.log").read_text()
        assert "trained-with-42" in train_log, train_log
        assert wait_until_no_jobs(settings["job_name"]) == []  # the pilot went once its sandbox was deleted
    finally:
        subprocess.run(["scancel", service], check=False)
    assert wait_until_no_jobs(service_name, 30) == []
    deadline = time.monotonic() + 10  # squeue no longer lists it while it is COMPLETING (its trap running)
    while (shared / "service.url").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (shared / "service.url").exists()  # the service job cleaned up on SIGTERM
    assert squeue_jobs(settings["job_name"]) == []
