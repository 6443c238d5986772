"""Fixtures of the Slurm backend's tests: the real single-node dev cluster, a shared
directory and a job name of its own per test, so leftovers are found by name."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from slurm_testing import REPO, slurm_settings, wait_until_no_jobs


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    result = subprocess.run(["bash", str(REPO / "slurm" / "dev-cluster.sh"), "up"], capture_output=True, text=True)
    assert result.returncode == 0, f"the dev cluster did not come up:\n{result.stderr[-3000:]}"


@pytest.fixture(scope="session")
def orchard_backend_settings(slurm_cluster) -> Iterator[dict[str, Any]]:
    """For the conformance suite: pilots of 8 sandboxes, at most 2 of them."""
    settings = slurm_settings(sandboxes_per_pilot=8, max_pilots=2, pilot_idle_seconds=30)
    yield {"slurm": settings}
    left = wait_until_no_jobs(settings["job_name"])
    subprocess.run(["scancel", "-n", settings["job_name"]], check=False)
    assert left == [], f"pilots left running after the conformance suite: {left}"


@pytest.fixture(scope="session")
def agent_bundle() -> Iterator[Path]:
    """An agent bundle of this checkout's code, for per-job containers (built in ~5 s),
    somewhere the unprivileged container uid can read."""
    from orchard.bundle.build import build_bundle

    parent = Path(tempfile.mkdtemp(prefix="orchard-slurm-bundle-", dir="/tmp"))
    parent.chmod(0o755)
    build_bundle(parent / "bundle")
    yield parent / "bundle"
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="session")
def kit_image() -> Iterator[Path]:
    """The conformance kit's directory image (shell, coreutils, python3, git) for runtimes
    that run images, built once from this machine's packages."""
    from orchard.testing.images import build_kit_image

    parent = Path(tempfile.mkdtemp(prefix="orchard-kit-image-", dir="/tmp"))
    parent.chmod(0o755)
    yield build_kit_image(parent / "image")
    shutil.rmtree(parent, ignore_errors=True)
