"""The pod, Secret and network policies of typical sandboxes, against golden files (regenerate
with ORCHARD_UPDATE_GOLDEN=1 and review the diff): what a cluster admin will see."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchard.models import SandboxSpec
from orchard_k8s import manifests
from orchard_k8s.config import K8sConfig

GOLDEN = Path(__file__).parent / "golden"
SPOT = K8sConfig(namespace="agents", instance="prod", injector_image="registry.example/orchard/injector:0.1.0",
                 node_selector={"cloud.google.com/gke-spot": "true"},
                 tolerations=[{"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                               "effect": "NoSchedule"}],
                 runtime_class_name="gvisor", priority_class_name="orchard-sandbox", image_pull_secrets=["regcred"],
                 run_as_user=1000)


def scenarios() -> dict:
    typical = SandboxSpec(sandbox_id="swe-task-42", image="ghcr.io/acme/swe-task:42", cpu="2", memory="4Gi",
                          disk="10Gi", env={"TASK": "42"}, labels={"run": "rl-7"})
    return {
        "typical sandbox on spot nodes with gVisor (network blocked)": manifests.pod_manifest(typical, SPOT),
        "bundle from an image volume, network allowed": manifests.pod_manifest(
            typical.model_copy(update={"block_network": False}),
            SPOT.model_copy(update={"bundle_from_image_volume": True, "run_as_user": None, "read_only_root": True})),
        "its key": manifests.secret_manifest("swe-task-42", "not-a-real-key", SPOT, {"name": "p", "uid": "u-1"}),
        "namespace policies": manifests.network_policies(SPOT),
    }


@pytest.mark.parametrize("name", ["manifests"])
def test_manifests_match_the_golden_file(name):
    made = json.loads(json.dumps(scenarios()))
    path = GOLDEN / f"{name}.json"
    if os.environ.get("ORCHARD_UPDATE_GOLDEN"):
        path.write_text(json.dumps(made, indent=2, sort_keys=True) + "\n")
    assert made == json.loads(path.read_text())


def test_pod_names_are_valid_dns_labels_for_any_sandbox_id():
    import re

    for sandbox_id in ("A", "x" * 63, "UPPER_case.dots-", "sbx-123", "9lives", "-".join(["a"] * 30)):
        name = manifests.pod_name(sandbox_id)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name) and len(manifests.secret_name(sandbox_id)) <= 63
    assert manifests.pod_name("Abc") != manifests.pod_name("abc")  # ids differing in case stay apart


def test_the_key_is_referenced_never_inlined():
    pod = manifests.pod_manifest(SandboxSpec(sandbox_id="s1", image="img"), SPOT)
    (env,) = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "ORCHARD_AGENT_TOKEN"]
    assert "value" not in env and env["valueFrom"]["secretKeyRef"]["name"] == manifests.secret_name("s1")
    assert pod["spec"]["automountServiceAccountToken"] is False
