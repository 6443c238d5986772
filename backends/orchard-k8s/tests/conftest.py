"""Fixtures of the Kubernetes backend's tests: the Pod-API test server (a test double: no
Kubernetes API server can run on our machines) with the agent bundle and the kit image."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from pod_api_server import KIT_IMAGE, PodApiTestServer  # noqa: E402




@pytest.fixture(scope="session")
def k8s_files() -> Iterator[tuple[Path, Path]]:
    """The agent bundle and the kit image, built once, readable by the pods' unprivileged uid."""
    from orchard.bundle.build import build_bundle
    from orchard.testing.images import build_kit_image

    parent = Path(tempfile.mkdtemp(prefix="orchard-k8s-test-", dir="/tmp"))
    parent.chmod(0o755)
    build_bundle(parent / "bundle")
    yield parent / "bundle", build_kit_image(parent / "kit-image")
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="session")
def pod_api(k8s_files) -> Iterator[PodApiTestServer]:
    bundle, image = k8s_files
    server = PodApiTestServer(bundle, {KIT_IMAGE: image}).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def k8s_settings(pod_api, tmp_path_factory) -> dict[str, Any]:
    kubeconfig = pod_api.kubeconfig(tmp_path_factory.mktemp("kube") / "config")
    return {"kubeconfig": str(kubeconfig), "namespace": "orchard-test", "start_timeout": 60}


@pytest.fixture(scope="session")
def orchard_backend_settings(k8s_settings) -> dict[str, Any]:
    return {"k8s": k8s_settings}


@pytest.fixture(scope="session")
def orchard_image() -> str:
    return KIT_IMAGE


@pytest.fixture(scope="session")
def orchard_unsupported() -> frozenset[str]:
    # pods get CPU and memory from their limits (the test double runs no cgroups: see the
    # kit test module); pids are the node's; ephemeral storage is the kubelet's to evict on
    return frozenset({"pids"})
