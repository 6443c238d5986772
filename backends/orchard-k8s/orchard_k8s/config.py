"""The ``k8s`` backend's settings (``backend.settings`` in the server's config file)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from orchard.backends.api import BackendConfig


class K8sConfig(BackendConfig):
    namespace: str = Field("orchard", description="namespace of the sandbox pods (the server's RBAC is scoped to it)")
    kubeconfig: Optional[str] = Field(None, description="kubeconfig file; unset: the in-cluster service account")
    context: Optional[str] = Field(None, description="kubeconfig context")
    instance: str = Field("default", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
                          description="this server's name in pod labels: several servers can share a namespace")
    injector_image: str = Field("ghcr.io/orchard-rl/agent-injector:0.1.0",
                                description="image holding the agent bundle (docker/agent-injector)")
    bundle_from_image_volume: bool = Field(False, description="mount the bundle read-only from the injector image "
                                           "(Kubernetes image volumes) instead of copying it with an init container")
    agent_port: int = Field(8787, ge=1, le=65535, description="port of the agent in each pod")
    image_pull_secrets: list[str] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict, description="e.g. a spot node pool's label")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="e.g. the spot pool's taint")
    affinity: Optional[dict[str, Any]] = None
    runtime_class_name: Optional[str] = Field(None, description="e.g. gvisor or kata")
    priority_class_name: Optional[str] = None
    gpus_per_sandbox: int = Field(0, ge=0, description="nvidia.com/gpu limit of each pod")
    run_as_user: Optional[int] = Field(None, ge=1, description="run the image as this uid (and non-root)")
    read_only_root: bool = Field(False, description="read-only root filesystem (/tmp and the workdir stay writable)")
    create_concurrency: int = Field(32, ge=1, description="pod creations in flight at once")
    start_timeout: float = Field(300.0, gt=0, description="seconds a pod may take to be ready (image pulls included)")
    api_retries: int = Field(5, ge=0, description="retries of an API call answered 429 or 5xx, or whose connection failed (with backoff)")
