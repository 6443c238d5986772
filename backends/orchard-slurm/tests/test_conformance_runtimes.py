"""The whole conformance kit (life cycle, exec, files, isolation, hostile cases) against the
runtimes that run images rather than the host view: Charliecloud and Podman sandboxes on
pilots, and per-job containers, on the dev cluster with the kit's directory image.
Per-job sandboxes have their job's resources and declare every per-sandbox limit
unsupported: the kit checks each is refused by name instead."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from orchard.testing.conformance import *  # noqa: F401,F403
from orchard_slurm.runtimes.charliecloud import CharliecloudRuntime
from orchard_slurm.runtimes.podman import PodmanRuntime
from slurm_testing import require, slurm_client, slurm_settings

TARGETS = {
    "charliecloud-pilot": ({"runtime": "charliecloud"}, CharliecloudRuntime, frozenset()),
    # Podman cannot size its writable layer here: disk is refused by name
    "podman-pilot": ({"runtime": "podman"}, PodmanRuntime, frozenset({"disk"})),
    "bwrap-per-job": ({"mode": "per-job", "runtime": "bwrap", "max_pilots": 4}, None,
                      frozenset({"memory", "pids", "cpu", "disk"})),
}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def kit_target(request, slurm_cluster, kit_image, agent_bundle) -> Iterator[tuple[Any, str, frozenset[str]]]:
    overrides, runtime, unsupported = TARGETS[request.param]
    if runtime is not None:
        require(runtime)
    settings = slurm_settings(**{"sandboxes_per_pilot": 8, "max_pilots": 2, "pilot_idle_seconds": 30,
                                 "bundle_dir": str(agent_bundle), **overrides})
    settings["image_dirs"].append(str(kit_image.parent))
    with slurm_client(settings) as client:
        yield client, str(kit_image), unsupported


@pytest.fixture(scope="module")
def orchard_client(kit_target):
    return kit_target[0]


@pytest.fixture(scope="module")
def orchard_image(kit_target) -> str:
    return kit_target[1]


@pytest.fixture(scope="module")
def orchard_unsupported(kit_target) -> frozenset[str]:
    return kit_target[2]
