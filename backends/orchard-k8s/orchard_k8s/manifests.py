"""What the backend asks the API server for, as plain dicts (golden-tested): a sandbox's pod
and token Secret, and the namespace's network policies.

The pod: the task image is the main container, its command the agent bundle's launcher
(``/orchard/bin/orchard-agent --runtime direct``: the container *is* the sandbox). The bundle
arrives through an init container that copies it from the injector image into an
``emptyDir``, or, where the cluster has image volumes, read-only straight from that image.
The agent's key comes from the sandbox's Secret (never in the pod spec in clear); readiness
is the agent's ``/health``. No service-account token, no privilege escalation, every
capability dropped, the runtime's default seccomp profile.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any, Optional

from orchard.models import SandboxSpec
from orchard_k8s.config import K8sConfig

MANAGED = {"app.kubernetes.io/managed-by": "orchard"}
INSTANCE_LABEL = "orchard.dev/instance"
EGRESS_LABEL = "orchard.dev/egress"  # "allowed" on sandboxes that asked for the network
SANDBOX_ANNOTATION = "orchard.dev/sandbox-id"
SPEC_ANNOTATION = "orchard.dev/spec"
BUNDLE_DIR = "/orchard"
AGENT_STATE = "/tmp/.orchard-agent"
DENY_ALL_POLICY = "orchard-sandboxes-deny-all"
ALLOW_EGRESS_POLICY = "orchard-sandboxes-allow-egress"
SERVER_LABEL = {"app.kubernetes.io/name": "orchard-server"}  # who may reach the agents (k8s/ manifests)
TRAINER_LABEL = {"orchard.dev/role": "trainer"}


def pod_name(sandbox_id: str) -> str:
    """A DNS-1123 name for a sandbox id (ids allow upper case, '_' and '.'; names do not)."""
    readable = re.sub(r"[^a-z0-9-]", "-", sandbox_id.lower()).strip("-")[:40] or "sandbox"
    if not readable.startswith("sbx-"):
        readable = f"sbx-{readable}"
    return f"{readable}-{hashlib.sha256(sandbox_id.encode()).hexdigest()[:8]}"


def secret_name(sandbox_id: str) -> str:
    return pod_name(sandbox_id) + "-key"


def selector(config: K8sConfig) -> str:
    """The label selector of this server's sandbox pods (the shared watch uses it)."""
    return ",".join(f"{key}={value}" for key, value in {**MANAGED, INSTANCE_LABEL: config.instance}.items())


def resources(spec: SandboxSpec, config: K8sConfig) -> dict[str, Any]:
    """Requests equal to limits (Guaranteed QoS when CPU and memory are both given)."""
    limits: dict[str, str] = {}
    if spec.cpu:
        limits["cpu"] = str(spec.cpu)
    if spec.memory:
        limits["memory"] = str(spec.memory)
    if spec.disk:
        limits["ephemeral-storage"] = str(spec.disk)
    if config.gpus_per_sandbox:
        limits["nvidia.com/gpu"] = str(config.gpus_per_sandbox)
    return {"requests": dict(limits), "limits": limits} if limits else {}


def bundle_volume(config: K8sConfig) -> dict[str, Any]:
    if config.bundle_from_image_volume:
        return {"name": "orchard-bundle", "image": {"reference": config.injector_image, "pullPolicy": "IfNotPresent"}}
    return {"name": "orchard-bundle", "emptyDir": {}}


def pod_manifest(spec: SandboxSpec, config: K8sConfig) -> dict[str, Any]:
    sandbox_id = str(spec.sandbox_id)
    labels = {**MANAGED, INSTANCE_LABEL: config.instance}
    if not spec.block_network:
        labels[EGRESS_LABEL] = "allowed"
    security: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                "seccompProfile": {"type": "RuntimeDefault"},
                                "readOnlyRootFilesystem": config.read_only_root}
    if config.run_as_user is not None:
        security.update(runAsUser=config.run_as_user, runAsGroup=config.run_as_user, runAsNonRoot=True)
    main = {
        "name": "sandbox", "image": spec.image,
        "command": [f"{BUNDLE_DIR}/bin/orchard-agent", "--runtime", "direct", "--host", "0.0.0.0",
                    "--port", str(config.agent_port), "--state-dir", AGENT_STATE],
        "env": [{"name": "ORCHARD_AGENT_TOKEN",
                 "valueFrom": {"secretKeyRef": {"name": secret_name(sandbox_id), "key": "token"}}},
                *({"name": key, "value": value} for key, value in sorted(spec.env.items()))],
        "ports": [{"name": "agent", "containerPort": config.agent_port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": config.agent_port},
                           "periodSeconds": 1, "failureThreshold": 3},
        "resources": resources(spec, config),
        "securityContext": security,
        "volumeMounts": [{"name": "orchard-bundle", "mountPath": BUNDLE_DIR, "readOnly": True},
                         *([{"name": "tmp", "mountPath": "/tmp"}] if config.read_only_root else [])],
    }
    pod_spec: dict[str, Any] = {
        "containers": [main],
        "volumes": [bundle_volume(config), *([{"name": "tmp", "emptyDir": {}}] if config.read_only_root else [])],
        "restartPolicy": "Never",  # a sandbox that dies is lost, never silently restarted empty
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostname": pod_name(sandbox_id)[:63],
        "terminationGracePeriodSeconds": 5,
    }
    if not config.bundle_from_image_volume:
        pod_spec["initContainers"] = [{
            "name": "orchard-agent-injector", "image": config.injector_image, "args": [BUNDLE_DIR],
            "volumeMounts": [{"name": "orchard-bundle", "mountPath": BUNDLE_DIR}],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }]
    for key, value in (("nodeSelector", config.node_selector), ("tolerations", config.tolerations),
                       ("affinity", config.affinity), ("runtimeClassName", config.runtime_class_name),
                       ("priorityClassName", config.priority_class_name)):
        if value:
            pod_spec[key] = value
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in config.image_pull_secrets]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(sandbox_id), "namespace": config.namespace, "labels": labels,
                         "annotations": {SANDBOX_ANNOTATION: sandbox_id,
                                         SPEC_ANNOTATION: spec.model_dump_json(exclude_none=True)}},
            "spec": pod_spec}


def secret_manifest(sandbox_id: str, token: str, config: K8sConfig, owner: Optional[dict[str, str]] = None) -> dict:
    """The agent's key; owned by its pod (``owner``: name and uid), so deleting the pod deletes it."""
    metadata: dict[str, Any] = {"name": secret_name(sandbox_id), "namespace": config.namespace,
                                "labels": {**MANAGED, INSTANCE_LABEL: config.instance}}
    if owner:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": owner["name"],
                                        "uid": owner["uid"], "blockOwnerDeletion": False}]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
            "data": {"token": base64.b64encode(token.encode()).decode()}}


def network_policies(config: K8sConfig) -> list[dict[str, Any]]:
    """Created once per namespace: sandboxes get no traffic at all, except ingress to the agent
    from the server and trainers; sandboxes labelled egress=allowed may also reach out."""
    sandboxes = {"matchLabels": {**MANAGED}}
    from_clients = [{"podSelector": {"matchLabels": SERVER_LABEL}}, {"podSelector": {"matchLabels": TRAINER_LABEL}}]
    deny_all = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": DENY_ALL_POLICY, "namespace": config.namespace, "labels": dict(MANAGED)},
                "spec": {"podSelector": sandboxes, "policyTypes": ["Ingress", "Egress"],
                         "ingress": [{"from": from_clients, "ports": [{"port": config.agent_port, "protocol": "TCP"}]}],
                         "egress": []}}
    allow = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": {"name": ALLOW_EGRESS_POLICY, "namespace": config.namespace, "labels": dict(MANAGED)},
             "spec": {"podSelector": {"matchLabels": {**MANAGED, EGRESS_LABEL: "allowed"}},
                      "policyTypes": ["Egress"], "egress": [{}]}}
    return [deny_all, allow]


def spec_of(pod_annotations: dict[str, str]) -> Optional[SandboxSpec]:
    """The sandbox spec a pod was made for (from its annotation), or None if unreadable."""
    try:
        return SandboxSpec(**json.loads(pod_annotations.get(SPEC_ANNOTATION, "")))
    except (ValueError, TypeError):
        return None
