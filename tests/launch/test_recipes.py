"""The launch recipes (slurm/orchard-launch.sbatch, k8s/launch/*.yaml): the two launch files
differ in their `platform` section only, and the script and the manifests decide nothing an
Orchard setting could: they run the same `orchard launch ... --config FILE` commands, pass no
other argument and no environment but the API key, and mount only the launch file. What the
platforms' own languages hold (sbatch directives, pod resources and images) is the job's shape,
not Orchard's settings."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from orchard.launch.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "orchard-launch.sbatch"
SLURM_FILE, K8S_FILE = REPO / "slurm" / "launch.yaml", REPO / "k8s" / "launch" / "launch.yaml"
JOB, RAYJOB = REPO / "k8s" / "launch" / "job.yaml", REPO / "k8s" / "launch" / "rayjob.yaml"
POLICY = REPO / "k8s" / "launch" / "network-policy.yaml"
CONFIG = "<launch file>"
SERVE, TRAIN = ("orchard", "launch", "serve", "--config", CONFIG), ("orchard", "launch", "train", "--config", CONFIG)


def test_the_two_launch_files_differ_in_their_platform_section_only():
    slurm, k8s = (yaml.safe_load(p.read_text()) for p in (SLURM_FILE, K8S_FILE))
    assert set(slurm) == set(k8s) and "platform" in slurm
    assert {key: value for key, value in slurm.items() if key != "platform"} == \
           {key: value for key, value in k8s.items() if key != "platform"}
    assert (slurm["platform"]["backend"]["name"], k8s["platform"]["backend"]["name"]) == ("slurm", "k8s")


def test_each_launch_file_is_valid_for_everything_that_reads_it(tmp_path):
    from orchard.integrations.slime import SlimeSettings
    from orchard.server.config import ServerConfig
    from orchard.train.rl_config import RLConfig
    from orchard.train.rl_run import check_keys
    from orchard_k8s.config import K8sConfig
    from orchard_slurm.config import SlurmConfig

    for path, backend_model in ((SLURM_FILE, SlurmConfig), (K8S_FILE, K8sConfig)):
        recipe = Recipe.load(path)
        server = ServerConfig(**recipe.server_config())
        backend_model(**server.backend.settings)  # the backend's own model accepts its settings
        rl = recipe.rl_config("http://server:8000")
        check_keys(rl)
        RLConfig(output_dir=Path(rl["output_dir"]), **rl["trainer"])
        (tmp_path / "slime.yaml").write_text(yaml.safe_dump(recipe.slime_settings("http://server:8000", "k")))
        assert SlimeSettings.load(str(tmp_path / "slime.yaml")).server_url == "http://server:8000"


def script_commands(text: str) -> set[tuple[str, ...]]:
    """Every `orchard ...` command of a shell script (comment lines aside), its config path as CONFIG."""
    found = set()
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for match in re.finditer(r"\borchard\s[^&|;)\n]*", line):
            found.add(tuple(CONFIG if t == "$ORCHARD_LAUNCH_CONFIG" else t for t in shlex.split(match.group(0))))
    return found


def pod_specs(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if document["kind"] == "Job":
        yield document["spec"]["template"]["spec"]
    elif document["kind"] == "RayJob":
        cluster = document["spec"]["rayClusterSpec"]
        yield cluster["headGroupSpec"]["template"]["spec"]
        for group in cluster["workerGroupSpecs"]:
            yield group["template"]["spec"]


def manifest_commands(documents: list[dict[str, Any]], workdir: str) -> set[tuple[str, ...]]:
    """Every command of the manifests' containers and RayJob entrypoints, the launch file as CONFIG;
    asserts on the way that no container gets any other setting (env, config maps, volumes)."""
    found = set()
    for document in documents:
        if document["kind"] == "RayJob":
            found.add(tuple(shlex.split(document["spec"]["entrypoint"])))
        for spec in pod_specs(document):
            volumes = {v["name"]: v for v in spec["volumes"]}
            for container in spec.get("initContainers", []) + spec["containers"]:
                assert {e["name"] for e in container.get("env", [])} <= {"ORCHARD_API_KEY"}, container["name"]
                assert "envFrom" not in container
                mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
                maps = [v["configMap"]["name"] for v in mounts.values() if "configMap" in v]
                assert maps in ([], ["orchard-launch"]), f"{container['name']} mounts another config: {maps}"
                assert mounts.get(workdir, {}).get("persistentVolumeClaim"), f"{container['name']}: no {workdir}"
                command = [*container.get("command", []), *container.get("args", [])]
                if command:
                    found.add(tuple(command))
    launch_file = "/etc/orchard/launch.yaml"  # the ConfigMap's key launch.yaml, mounted at /etc/orchard
    return {tuple(CONFIG if t == launch_file else t for t in command) for command in found}


def manifests() -> list[dict[str, Any]]:
    return [d for path in (JOB, RAYJOB) for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_script_and_the_manifests_run_the_same_commands_with_the_launch_file():
    workdir = yaml.safe_load(K8S_FILE.read_text())["platform"]["workdir"]
    assert script_commands(SBATCH.read_text()) == {SERVE, TRAIN, (*TRAIN[:2], "get", "--config", CONFIG, "trainer")}
    assert manifest_commands(manifests(), workdir) == {SERVE, TRAIN}
    exported = set(re.findall(r"^\s*export\s+(\w+)", SBATCH.read_text(), re.MULTILINE))
    assert exported == {"ORCHARD_API_KEY", "RAY_ADDRESS"}  # the key and Ray's address, no Orchard setting


def test_the_checks_catch_a_setting_written_into_a_script_or_a_manifest():
    """Not vacuous: an extra argument, an extra variable or another config file is caught."""
    script = SBATCH.read_text().replace('launch train --config "$ORCHARD_LAUNCH_CONFIG"',
                                        'launch train --config "$ORCHARD_LAUNCH_CONFIG" --steps 3')
    assert TRAIN not in script_commands(script)
    documents = manifests()
    trainer = documents[1]["spec"]["template"]["spec"]["containers"][0]
    trainer["args"] = [*trainer["args"], "--steps", "3"]
    assert manifest_commands(documents, "/work") != {SERVE, TRAIN}
    trainer["env"].append({"name": "ORCHARD_STEPS", "value": "3"})
    with pytest.raises(AssertionError, match="trainer"):
        manifest_commands(documents, "/work")


def test_the_job_manifest_passes_the_kubernetes_schemas_and_the_rayjobs_pods_too(tmp_path):
    """kubernetes-validate cannot check a CRD: the RayJob's pod templates are checked as
    PodTemplates; its own fields (entrypoint, rayClusterSpec) only by the tests above."""
    rayjob = yaml.safe_load(RAYJOB.read_text())
    assert (rayjob["apiVersion"], rayjob["kind"]) == ("ray.io/v1", "RayJob")
    templates = [rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"],
                 *[g["template"] for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]]]
    for index, template in enumerate(templates):
        (tmp_path / f"pod-{index}.yaml").write_text(yaml.safe_dump(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{index}", "namespace": "orchard"},
             "template": template}))
    command = [sys.executable, "-m", "kubernetes_validate", "--strict", "--kubernetes-version", "1.33"]
    result = subprocess.run([*command, str(JOB), str(POLICY), *map(str, sorted(tmp_path.glob("*.yaml")))],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    (tmp_path / "broken.yaml").write_text(JOB.read_text().replace("restartPolicy: Always", "restartPolicyy: Always"))
    assert subprocess.run([*command, str(tmp_path / "broken.yaml")], capture_output=True).returncode != 0


def test_every_launch_script_is_bash_n_clean():
    scripts = sorted([*(REPO / "slurm").glob("*.sbatch"), *(REPO / "slurm").glob("*.sh")])
    assert SBATCH in scripts and len(scripts) >= 4
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"
        assert "set -euo pipefail" in script.read_text(), script.name


def test_no_sandbox_may_reach_a_launchs_pods():
    """Ray's head takes jobs without authentication, beside the API key and the GPUs: the
    launch's pods admit anything but sandbox pods (the label every sandbox pod carries)."""
    from orchard_k8s import manifests
    from orchard_k8s.config import K8sConfig
    from orchard.models import SandboxSpec

    policy = yaml.safe_load(POLICY.read_text())
    selected = policy["spec"]["podSelector"]["matchLabels"]
    [job] = [doc for doc in yaml.safe_load_all(JOB.read_text()) if doc["kind"] == "Job"]
    ray = yaml.safe_load(RAYJOB.read_text())["spec"]["rayClusterSpec"]
    launch_pods = [job["spec"]["template"], ray["headGroupSpec"]["template"],
                   *[group["template"] for group in ray["workerGroupSpecs"]]]
    for template in launch_pods:
        assert selected.items() <= template["metadata"]["labels"].items()
    [rule] = policy["spec"]["ingress"]
    [source] = rule["from"]
    [expression] = source["podSelector"]["matchExpressions"]
    sandbox = manifests.pod_manifest(SandboxSpec(image="img", sandbox_id="s1"), K8sConfig(namespace="orchard"))
    labels = sandbox["metadata"]["labels"]
    assert expression["operator"] == "NotIn" and labels.get(expression["key"]) in expression["values"]
