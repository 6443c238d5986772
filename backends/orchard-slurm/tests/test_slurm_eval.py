"""`orchard eval` on Slurm pilots, chosen in a config file: the same tasks, policy and grader
as on the local backend, with each task's starting state snapshotted on a pilot."""

from __future__ import annotations

import json
import random

import yaml
from click.testing import CliRunner

from orchard.cli.main import cli

from slurm_testing import slurm_settings, wait_until_no_jobs


def test_orchard_eval_on_slurm_pilots_measures_the_oracles_rate(slurm_cluster, kit_image, tmp_path):
    runner = CliRunner()
    tasks_file = tmp_path / "tasks.jsonl"
    made = runner.invoke(cli, ["tasks", "generate", "--n", "6", "--seed", "8", "--image", str(kit_image),
                               "--out", str(tasks_file)])
    assert made.exit_code == 0, made.output
    settings = slurm_settings(sandboxes_per_pilot=8, max_pilots=2, pilot_idle_seconds=0)
    settings["image_dirs"].append(str(kit_image.parent))
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"backend": {"name": "slurm", "settings": settings},
                                      "policy": {"kind": "oracle", "p": 0.5, "seed": 23}}))
    result = runner.invoke(cli, ["eval", str(tasks_file), "--config", str(config), "--attempts", "4",
                                 "--concurrency", "4", "--no-progress", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    draws = random.Random(23)
    assert report["statuses"] == {"completed": 24}
    assert report["resolved"] == sum(draws.random() < 0.5 for _ in range(24))
    low, high = report["pass_rate_95"]
    assert low <= 0.5 <= high
    assert wait_until_no_jobs(settings["job_name"]) == [], "the eval's pilots are gone once it is done"
