"""``orchard doctor --backend slurm`` against the real single-node dev cluster."""

from __future__ import annotations

import json
import subprocess
import sys


def test_doctor_passes_on_the_dev_cluster(slurm_cluster):
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "doctor", "--backend", "slurm", "--json"],
                            capture_output=True, text=True, timeout=120)
    report = json.loads(result.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert result.returncode == 0 and report["ok"], result.stdout
    assert checks["slurm controller"]["ok"] and checks["slurm accounting"]["ok"]
    assert checks["runtime bwrap (chosen)"]["ok"]  # the default runtime, asked through its own plugin


def test_doctor_checks_the_runtime_the_settings_choose(slurm_cluster, tmp_path):
    settings = tmp_path / "slurm.yaml"
    settings.write_text("runtime: no-such-runtime\n")
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "doctor", "--backend", "slurm", "--settings",
                             str(settings)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "unknown runtime 'no-such-runtime'" in result.stdout  # the config model's own words
    assert "runtime no-such-runtime (chosen): not installed" in result.stdout
