"""The apptainer runtime up to the exact command lines spython runs (Apptainer cannot be
installed here). ``RecordingApptainer`` is a test double standing in for the
``singularity`` binary: it records every command spython would run and answers
``instance list`` the way Apptainer 1.x does. Regenerate the golden file with
``ORCHARD_UPDATE_GOLDEN=1 pytest backends/orchard-slurm/tests/test_apptainer_golden.py``
after a deliberate change, and read the diff."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchard_slurm.perjob import SandboxJob, container_argv
from orchard_slurm.runtimes import spython_calls
from orchard_slurm.runtimes.apptainer import instance_name, instance_options, pilot_has_gpus, sif_name

GOLDEN = Path(__file__).parent / "golden" / "apptainer.json"


class RecordingApptainer:
    """Test double for the ``singularity`` binary behind spython: records, answers like 1.x."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []
        self.instances: dict[str, dict] = {}

    def run_command(self, cmd, sudo=False, capture=True, quiet=True, **_ignored):
        self.commands.append(list(cmd))
        verb = [part for part in cmd if not part.startswith("--")][1:3]
        if verb == ["instance", "start"]:
            image, name = cmd[-2], cmd[-1]
            self.instances[name] = {"instance": name, "pid": 4242 + len(self.instances), "img": image}
        elif verb == ["instance", "list"]:
            listed = [self.instances[cmd[-1]]] if cmd[-1] in self.instances else list(self.instances.values())
            return {"message": [json.dumps({"instances": listed})], "return_code": 0}
        elif verb[:1] == ["pull"]:
            folder, name = cmd[cmd.index("--dir") + 1] if "--dir" in cmd else "", cmd[-2]
            Path(folder, name).write_bytes(b"SIF")
        return {"message": [""], "return_code": 0}


@pytest.fixture
def apptainer(monkeypatch) -> RecordingApptainer:
    import spython.utils

    fake = RecordingApptainer()
    monkeypatch.setattr(spython.utils, "run_command", fake.run_command)
    monkeypatch.setattr(spython.utils, "check_install", lambda *a, **k: True)
    for module in ("spython.main.pull", "spython.main.instances"):
        monkeypatch.setattr(f"{module}.run_command", fake.run_command, raising=False)
    monkeypatch.setattr("spython.main.base.Client.version", lambda self: "apptainer version 1.3.4", raising=False)
    return fake


def scenario_commands(apptainer: RecordingApptainer, tmp_path: Path) -> dict[str, list[list[str]]]:
    recorded: dict[str, list[list[str]]] = {}
    cache = tmp_path / "sif-cache"
    cache.mkdir()
    reference = "docker://python:3.11-slim"
    pulled = spython_calls.pull(reference, str(cache), sif_name(reference))["path"]
    recorded["pull docker image into the SIF cache"] = apptainer.commands
    apptainer.commands = []

    overlay = Path("/scratch/orchard/sandboxes/sbx-1/overlay")
    options = instance_options("sbx-1", True, overlay, [], gpus=False)
    assert spython_calls.start(pulled.replace(str(cache), "/cache"), instance_name("sbx-1"), options) == {"pid": 4242}
    recorded["start: network blocked, no GPUs"] = apptainer.commands
    apptainer.commands = []

    options = instance_options("sbx-2", False, overlay, ["/scratch/data:/data:ro"], gpus=True)
    spython_calls.start("/images/train.sif", instance_name("sbx-2"), options)
    recorded["start: network open, site bind, GPUs"] = apptainer.commands
    apptainer.commands = []

    spython_calls.stop(instance_name("sbx-1"))
    recorded["stop"] = apptainer.commands

    job = SandboxJob("/shared/pilots/pilot-1", "sbx-3", "/images/swe.sif", "apptainer", True, "/shared/agent-bundle")
    recorded["per-job container: the bundled agent inside, network blocked"] = [
        container_argv(job, Path(job.image), True)]
    return recorded


def test_command_lines_match_the_golden_file(apptainer, tmp_path):
    recorded = json.loads(json.dumps(scenario_commands(apptainer, tmp_path)).replace(str(tmp_path), "$TMP"))
    if os.environ.get("ORCHARD_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(recorded, indent=2) + "\n")
    assert recorded == json.loads(GOLDEN.read_text())


def test_options_never_drop_block_network_and_follow_the_pilots_gpus():
    blocked = instance_options("a", True, Path("/o"), [], gpus=False)
    assert blocked[-3:] == ["--net", "--network", "none"] and "--containall" in blocked
    assert "--net" not in instance_options("a", False, Path("/o"), [], gpus=False)
    assert pilot_has_gpus({"SLURM_JOB_GPUS": "0,1"}) and not pilot_has_gpus({})
    assert instance_name("a/b c") == "orchard-a-b-c"
    assert sif_name("docker://python:3.11").endswith(".sif") and sif_name("docker://a") != sif_name("docker://b")
