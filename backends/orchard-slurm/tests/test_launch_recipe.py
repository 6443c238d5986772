"""slurm/orchard-launch.sbatch on the dev cluster, end to end with the standalone trainer in
place of slime: the script starts the Orchard server (Slurm backend: its sandboxes live in a
pilot job) and `orchard launch train` beside it; one RL step of a tiny model trained here
leaves a checkpoint and metrics in the launch file's workdir. The dev cluster is one node
with 2 CPUs and no GPU, so the script runs as the homogeneous job its header documents for
sites without heterogeneous jobs (here a heterogeneous job never starts: the backfill log
plans component 1 on the one node only after component 0 would end), with its resources
scaled down on the sbatch command line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurm_testing import REPO, slurm_settings, wait_until_no_jobs
from tests.images import free_port  # importable once slurm_testing put the repository on sys.path

SCRIPT = REPO / "slurm" / "orchard-launch.sbatch"
SMALL = ["--cpus-per-task=1", "--mem=3G", "--time=10", "--gpus-per-node=0"]  # the dev node: 2 CPUs, no GPU


def homogeneous(script: str) -> str:
    """The script as a site without heterogeneous jobs runs it: no #SBATCH line from `hetjob` on."""
    lines = script.splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH hetjob"))
    return "".join(lines[:cut] + [line for line in lines[cut:] if not line.startswith("#SBATCH")])


def sbatch_test_only(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    command = ["sbatch", "--test-only", *SMALL, *args] + ([] if script else [str(SCRIPT)])
    return subprocess.run(command, input=script, capture_output=True, text=True)


@pytest.mark.slurm
def test_sbatch_accepts_the_scripts_directives_heterogeneous_or_not(slurm_cluster):
    """--test-only: Slurm parses every directive and finds the (scaled-down) job placeable."""
    for result in (sbatch_test_only(), sbatch_test_only(script=homogeneous(SCRIPT.read_text()))):
        assert result.returncode == 0 and "to start" in result.stderr, result.stderr
    refused = sbatch_test_only(script=SCRIPT.read_text().replace("--nodes=1", "--nodez=1", 1))
    assert refused.returncode != 0  # not vacuous: a misspelt directive is refused


def tiny_run(workdir: Path, kit_image: Path) -> dict:
    """A tiny base model and one task in the workdir, and the launch file pointing at them."""
    from orchard.tasks import save_tasks
    from orchard.tasks.generated import generate_suite
    from tests.rollout.tiny_lm import make_tokenizer, tiny_model

    tokenizer = make_tokenizer()
    tiny_model(tokenizer).save_pretrained(workdir / "model")
    tokenizer.save_pretrained(workdir / "model")
    save_tasks(generate_suite(1, seed=3, image=str(kit_image)), workdir / "tasks.jsonl")
    settings = slurm_settings(sandboxes_per_pilot=4, max_pilots=1, pilot_idle_seconds=0, cpus_per_pilot=1,
                              mem_per_pilot_gb=1)
    settings["image_dirs"].append(str(kit_image.parent))
    return {"platform": {"workdir": str(workdir), "advertise": "fqdn", "wait_seconds": 120,
                         "backend": {"name": "slurm", "settings": settings}},
            "server": {"port": free_port(), "log_level": "warning"},
            "trainer": "standalone",
            "rl": {"model": "model", "tasks": "tasks.jsonl", "output_dir": "rl", "device": "cpu",
                   "sampling": {"seed": 0}, "engine": {"max_concurrent": 2},
                   "rollout": {"max_turns": 1, "max_tokens_per_turn": 8},
                   "trainer": {"steps": 1, "tasks_per_step": 1, "group_size": 2, "max_rollouts": 2, "stride": 2}}}


@pytest.mark.slurm
def test_the_launch_script_trains_with_the_standalone_trainer_on_slurm_pilots(slurm_cluster, kit_image, tmp_path):
    workdir = Path(slurm_settings()["shared_dir"])  # /tmp, readable by the sandboxes' uid
    recipe = tiny_run(workdir, kit_image)
    (workdir / "launch.yaml").write_text(yaml.safe_dump(recipe))
    pilots = recipe["platform"]["backend"]["settings"]["job_name"]
    export = f"--export=ALL,ORCHARD_LAUNCH_CONFIG={workdir / 'launch.yaml'},ORCHARD_VENV={sys.prefix}"
    try:
        done = subprocess.run(["sbatch", "--wait", *SMALL, "--job-name=" + pilots + "-launch",
                               f"--output={workdir}/launch.log", export],
                              input=homogeneous(SCRIPT.read_text()), capture_output=True, text=True, timeout=240)
        log = (workdir / "launch.log").read_text() if (workdir / "launch.log").exists() else ""
        assert done.returncode == 0, done.stderr + log[-4000:]
        [record] = [json.loads(line) for line in (workdir / "rl" / "metrics.jsonl").read_text().splitlines()]
        assert record["step"] == 1 and record["rollouts"] == 2 and record["samples"] == 2, record
        assert record["sandbox_errors"] == 0, log[-4000:]
        assert (workdir / "rl" / "checkpoint-1" / "state.pt").exists()
        assert (workdir / "rl" / "final" / "config.json").exists()
        assert f":{recipe['server']['port']}" in log  # the server it started announced itself
        ran = subprocess.run(["sacct", "-n", "-X", f"--name={pilots}", "-o", "JobID"], capture_output=True,
                             text=True).stdout.split()
        assert ran, "the rollouts' sandboxes ran in a pilot job the server submitted"
        assert not (workdir / "launch" / "service.url").exists()  # the server stopped and said so
        assert wait_until_no_jobs(pilots, 30) == []  # and left no pilot behind
    finally:
        subprocess.run(["scancel", "-n", pilots], check=False)
        subprocess.run(["scancel", "-n", pilots + "-launch"], check=False)
    shutil.rmtree(workdir, ignore_errors=True)  # kept when the test failed, to read its logs
