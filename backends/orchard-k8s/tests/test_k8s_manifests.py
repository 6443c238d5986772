"""The deployment manifests in k8s/ and the pods the backend makes, validated offline against
the Kubernetes schemas (kubernetes-validate --strict: unknown fields are errors; no API
server needed), the server's config checked by the server's own model, and the RBAC rules
against a golden list: least privilege, nothing cluster-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from orchard.server.config import ServerConfig
from orchard_k8s.config import K8sConfig
from test_manifests_golden import scenarios

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = sorted((REPO / "k8s").glob("*.yaml"))
VALIDATE = [sys.executable, "-m", "kubernetes_validate", "--strict", "--kubernetes-version", "1.33"]


def validate(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*VALIDATE, *map(str, paths)], capture_output=True, text=True)


def test_every_deployment_manifest_passes_the_schemas():
    assert {p.name for p in MANIFESTS} >= {"namespace.yaml", "rbac.yaml", "server.yaml", "network-policies.yaml",
                                           "trainer-job.yaml"}
    result = validate(*MANIFESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_pods_the_backend_makes_pass_the_schemas(tmp_path):
    made = [obj for obj in scenarios().values() for obj in (obj if isinstance(obj, list) else [obj])]
    for index, obj in enumerate(made):
        (tmp_path / f"{index}.yaml").write_text(yaml.safe_dump(obj))
    result = validate(*sorted(tmp_path.glob("*.yaml")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_validator_refuses_what_is_wrong(tmp_path):
    """Not vacuous: a misspelt field fails it."""
    broken = yaml.safe_load((REPO / "k8s" / "rbac.yaml").read_text().split("---")[1])
    broken["rules"][0]["verb"] = broken["rules"][0].pop("verbs")
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    assert validate(tmp_path / "broken.yaml").returncode != 0


def test_the_servers_config_map_is_a_valid_server_config():
    documents = list(yaml.safe_load_all((REPO / "k8s" / "server.yaml").read_text()))
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    config = ServerConfig(**yaml.safe_load(config_map["data"]["orchard.yaml"]))
    assert config.backend.name == "k8s"
    K8sConfig(**config.backend.settings)  # the backend's own model accepts its settings


def test_rbac_is_least_privilege_in_one_namespace():
    documents = [d for d in yaml.safe_load_all((REPO / "k8s" / "rbac.yaml").read_text()) if d]
    assert not [d for d in documents if d["kind"].startswith("Cluster")]
    (role,) = [d for d in documents if d["kind"] == "Role"]
    rules = sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"])
    assert rules == sorted([
        (("",), ("pods",), ("create", "delete", "get", "list", "watch")),
        (("",), ("pods/status",), ("get",)),
        (("",), ("secrets",), ("create", "delete", "get")),
        (("networking.k8s.io",), ("networkpolicies",), ("create", "get")),
    ])
    assert all("*" not in json.dumps(r) for r in role["rules"])
