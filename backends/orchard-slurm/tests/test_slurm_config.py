"""Settings that cannot work are refused when the service starts, naming the fix."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from orchard_slurm.config import SlurmConfig


@pytest.mark.skipif(os.geteuid() != 0, reason="only root services map sandboxes to another uid")
def test_a_shared_dir_below_a_private_directory_is_refused():
    private = Path(tempfile.mkdtemp(prefix="orchard-private-", dir="/tmp"))  # 0700, as mktemp -d makes it
    try:
        with pytest.raises(ValidationError, match=f"below {private} \\(mode 0700\\).*chmod o\\+x {private}"):
            SlurmConfig(shared_dir=private / "orchard")
        private.chmod(0o711)
        assert SlurmConfig(shared_dir=private / "orchard").shared_dir == private / "orchard"
    finally:
        shutil.rmtree(private)


def test_directory_images_come_from_configured_directories_only(tmp_path):
    config = SlurmConfig(shared_dir=Path("/tmp/orchard-shared"), image_dirs=[Path("/srv/images")])
    policy = config.image_policy()
    assert policy["image_dirs"] == ["/tmp/orchard-shared/images", "/srv/images"]
    assert policy["protected_dirs"] == ["/tmp/orchard-shared/pilots"]


def test_a_podman_pilot_claims_every_id_its_containers_map():
    """Podman maps 65,536 ids from the pilot's first; a block of sandboxes_per_pilot + 1 let
    another job's sandbox uid fall inside that range on the same node."""
    from orchard_slurm.config import PODMAN_ID_SPAN, SlurmConfig

    podman = SlurmConfig(shared_dir=Path("/tmp/orchard-shared"), runtime="podman", host_id_count=4 * PODMAN_ID_SPAN)
    assert podman.host_id_settings()[2:] == (PODMAN_ID_SPAN, 4)
    assert SlurmConfig(shared_dir=Path("/tmp/orchard-shared"), sandboxes_per_pilot=8).host_id_settings()[2] == 9


def test_every_image_setting_reaches_the_pilots_agent(tmp_path):
    """image_digests, signature_policy and registries_d were not passed to pilots (a review
    found signatures never enforced on Slurm); an empty allow-list stays empty."""
    from orchard.agent.settings import AgentSettings
    from orchard_slurm.pilot import IMAGE_POLICY_SETTINGS

    (tmp_path / "policy.json").write_text('{"default": [{"type": "reject"}]}')
    (tmp_path / "registries.d").mkdir()
    config = SlurmConfig(shared_dir=Path("/tmp/orchard-shared"), registries=[], image_digests=["sha256:" + "a" * 64],
                         signature_policy=tmp_path / "policy.json", registries_d=tmp_path / "registries.d")
    policy = config.image_policy()
    settings = AgentSettings(**{key: policy[key] for key in IMAGE_POLICY_SETTINGS if policy.get(key) is not None})
    assert settings.registries == [] and settings.image_digests == ["sha256:" + "a" * 64]
    assert settings.signature_policy == tmp_path / "policy.json" and settings.registries_d == tmp_path / "registries.d"
    assert settings.image_policy()["signature_policy"] == policy["signature_policy"]


def test_apptainer_refuses_to_pull_when_signatures_are_required(tmp_path):
    """Apptainer pulls docker://, oras://, library:// itself, without skopeo's trust policy."""
    import asyncio
    from types import SimpleNamespace

    from orchard.agent.settings import AgentSettings
    from orchard.errors import ImageRejected
    from orchard_slurm.runtimes.apptainer import ApptainerRuntime

    (tmp_path / "policy.json").write_text('{"default": [{"type": "reject"}]}')
    context = SimpleNamespace(settings=AgentSettings(state_dir=tmp_path / "state",  # the runtime reads only these
                                                     signature_policy=tmp_path / "policy.json"), images=None)
    runtime = ApptainerRuntime.__new__(ApptainerRuntime)
    runtime.context = context
    for reference in ("docker://ghcr.io/org/img:v1", "oras://ghcr.io/org/img:v1", "library://e/c/img:v1"):
        with pytest.raises(ImageRejected, match="signature_policy is set"):
            asyncio.run(runtime._image(reference))
