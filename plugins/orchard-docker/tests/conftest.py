"""Fixtures: a real Podman Docker-API service with the kit's image, an agent bundle of this
checkout, and the backend's settings pointing at both."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from podman_service import KIT_IMAGE, PodmanService


@pytest.fixture(scope="session")
def podman() -> Iterator[PodmanService]:
    service = PodmanService().start()
    try:
        yield service
    finally:
        service.destroy()


@pytest.fixture(scope="session")
def scratch() -> Iterator[Path]:
    """Short paths (Unix socket paths are at most 107 bytes), readable by container users."""
    root = Path(tempfile.mkdtemp(prefix="odk-t-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def agent_bundle(scratch: Path) -> Path:
    from orchard.bundle.build import build_bundle

    build_bundle(scratch / "bundle")
    return scratch / "bundle"


@pytest.fixture(scope="session")
def kit_image(podman: PodmanService, scratch: Path) -> str:
    """The conformance kit's directory image (shell, coreutils, python3, git) imported into Podman."""
    from orchard.testing.images import build_kit_image

    podman.import_directory(build_kit_image(scratch / "kit"))
    return f"docker://{KIT_IMAGE}"


@pytest.fixture(scope="session")
def docker_settings(podman: PodmanService, agent_bundle: Path, kit_image: str, scratch: Path) -> dict[str, Any]:
    return {"docker_host": podman.url, "state_dir": str(scratch / "state"), "bundle_dir": str(agent_bundle),
            "registries": ["localhost"], "instance": "tests"}
