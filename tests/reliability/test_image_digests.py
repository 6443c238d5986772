"""The built-in image policy's digest allow-list: with `image_digests` set, a docker:// image
must be pinned by an allowed digest; a tag (which can be moved) or another digest is refused
with the setting's name. Unset, nothing changes. The registry allow-list still applies."""

from __future__ import annotations

from orchard.agent.settings import AgentSettings
from orchard.plugins import verify_image

GOOD = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


def policy(tmp_path, **settings):
    return AgentSettings(state_dir=tmp_path, **settings).image_policy()


def test_pinned_digests_only_when_configured(tmp_path):
    pinned = policy(tmp_path, image_digests=[GOOD])
    assert verify_image(f"docker://ghcr.io/org/img@{GOOD}", pinned) is None
    assert verify_image(f"docker://ghcr.io/org/img:v1@{GOOD.upper().replace('SHA256', 'sha256')}", pinned) is None
    tag = verify_image("docker://ghcr.io/org/img:v1", pinned)
    assert tag and "pinned by digest" in tag and "image_digests" in tag
    other = verify_image(f"docker://ghcr.io/org/img@{OTHER}", pinned)
    assert other and "not in the allowed image digests" in other
    assert verify_image("host", pinned) is None  # not a registry image


def test_registries_still_apply_to_pinned_images(tmp_path):
    pinned = policy(tmp_path, image_digests=[GOOD], registries=["ghcr.io"])
    refused = verify_image(f"docker://evil.example/img@{GOOD}", pinned)
    assert refused and "registry" in refused


def test_unset_means_tags_are_fine(tmp_path):
    assert verify_image("docker://ghcr.io/org/img:v1", policy(tmp_path)) is None


def test_the_agent_refuses_a_tag_before_pulling():
    """End to end through the local backend: 422 ImageRejected naming the setting, and no
    pull attempted (the registry on port 1 does not exist)."""
    import pytest

    from orchard.client import Client
    from orchard.errors import ImageRejected

    import os
    import shutil
    from pathlib import Path

    from orchard.backends.local.launcher import stop_agent

    state = Path(f"/tmp/orchard-digests-{os.getpid()}")
    agent = {"state_dir": str(state), "registries": ["127.0.0.1"], "image_digests": [GOOD]}
    try:
        with Client(backend_settings={"agent": agent}) as client:
            with pytest.raises(ImageRejected, match="image_digests"):
                client.create(image="docker://127.0.0.1:1/img:latest")
            with pytest.raises(ImageRejected, match="not in the allowed image digests"):
                client.create(image=f"docker://127.0.0.1:1/img@{OTHER}")
    finally:
        stop_agent(AgentSettings(state_dir=state))
        shutil.rmtree(state, ignore_errors=True)


def test_apptainer_schemes_pass_the_same_allow_lists(tmp_path):
    """oras://, library:// and shub:// (pulled by Apptainer on pilots) skipped the policy
    entirely before (an audit found it): any host, any tag, with digests pinned or not."""
    ours = policy(tmp_path, registries=["registry.example.org"])
    assert verify_image("oras://registry.example.org/team/img:v1", ours) is None
    assert "registry 'evil.example' is not in the allowed registries" in verify_image("oras://evil.example/x:v1", ours)
    assert "not in the allowed registries" in verify_image("oras://169.254.169.254:80/x:v1", ours)
    assert "not in the allowed registries" in verify_image("library://evil.example/entity/c/img:v1", ours)
    assert "default remote" in verify_image("library://entity/collection/img:latest", ours)
    assert "default remote" in verify_image("shub://user/image", ours)
    anywhere = policy(tmp_path, registries=["*"])
    assert verify_image("library://entity/collection/img:latest", anywhere) is None
    pinned = policy(tmp_path, image_digests=[GOOD], registries=["*"])
    assert "only docker:// images pinned by digest" in verify_image(f"oras://registry.example.org/x@{GOOD}", pinned)


def test_an_unknown_scheme_is_refused(tmp_path):
    for image in ("http://10.0.0.1/rootfs.tar", "file:///etc", "ftp://x/y", "instance://other-sandbox"):
        assert "is not supported" in verify_image(image, policy(tmp_path)), image


def test_apptainer_hosts_must_be_plain(tmp_path):
    """``allowed:443@evil`` reads as host "allowed" to a split at ':' and as host "evil" to a URL
    parser (a review found it passed the allow-list)."""
    ours = policy(tmp_path, registries=["allowed.example"])
    for image in ("oras://allowed.example:443@evil.example/x:v1", "library://allowed.example:443@evil.example/e/c/i:v1",
                  "shub://allowed.example:1@evil.example/u/c", "oras://allowed.example./x:v1"):
        assert "is not a plain host[:port]" in verify_image(image, ours), image
    assert verify_image("oras://allowed.example:5000/x:v1", ours) is None
