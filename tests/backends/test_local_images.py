"""Images on the local backend: root-filesystem directories and docker:// from a real registry."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from orchard.errors import ImageRejected
from tests.images import Registry, busybox_rootfs, have_image_tools

pytestmark = pytest.mark.skipif(not have_image_tools() and not os.environ.get("CI"),
                                reason="needs docker-registry, umoci, skopeo, busybox-static (make system-deps)")


@pytest.fixture(scope="module")
def scratch():
    path = Path(f"/tmp/orchard-images-{os.getpid()}")
    path.mkdir(mode=0o755, exist_ok=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def busybox_dir(scratch):
    return busybox_rootfs(scratch / "busybox-root")


@pytest.fixture(scope="module")
def registry(scratch):
    reg = Registry(scratch / "registry")
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def busybox_image(registry, busybox_dir):
    return registry.push_rootfs(busybox_dir, "busybox", env={"GREETING": "from-image-config"}, workdir="/app")


def test_rootfs_directory_image_with_private_writable_layers(orchard_client, busybox_dir):
    with orchard_client.create(str(busybox_dir)) as a, orchard_client.create(str(busybox_dir)) as b:
        assert a.exec("cat /etc/os-release").stdout.startswith('NAME="orchard-busybox"')
        assert a.exec("busybox uname -s").stdout == "Linux\n"
        a.exec("echo only-in-a > /etc/motd")
        assert a.exec("cat /etc/motd").stdout == "only-in-a\n"
        assert b.exec("cat /etc/motd 2>&1 || true").stdout.endswith("No such file or directory\n")
        a.upload("/workspace/up.txt", "uploaded")
        assert a.exec("cat /workspace/up.txt").stdout == "uploaded"
    assert not (busybox_dir / "etc/motd").exists(), "the image directory itself must never change"


def test_image_without_bash_falls_back_to_sh(orchard_client, busybox_dir):
    with orchard_client.create(str(busybox_dir)) as sandbox:
        job = sandbox.exec("echo $0; readlink /proc/$$/exe")
        assert job.exit_code == 0 and job.stdout.split()[0] == "sh"


def test_docker_image_from_registry_honours_config(orchard_client, busybox_image):
    with orchard_client.create(busybox_image) as sandbox:
        assert sandbox.exec("echo $GREETING").stdout == "from-image-config\n"
        assert sandbox.exec("pwd").stdout == "/app\n"
        assert "orchard-busybox" in sandbox.exec("cat /etc/os-release").stdout
        sandbox.exec("echo changed > /etc/os-release")
    with orchard_client.create(busybox_image) as fresh:
        assert "orchard-busybox" in fresh.exec("cat /etc/os-release").stdout


def test_docker_images_are_cached_by_digest(orchard_client, busybox_image, agent_settings):
    with orchard_client.create(busybox_image):
        pass
    cached = [p.name for p in agent_settings.images_dir.iterdir() if p.name.startswith("sha256-")]
    assert len(cached) == 1


def test_missing_image_is_a_clear_error(orchard_client, registry):
    with pytest.raises(ImageRejected, match="cannot be pulled"):
        orchard_client.create(f"docker://{registry.address}/no-such-image:latest")
    with pytest.raises(ImageRejected, match="does not exist"):
        orchard_client.create("/no/such/rootfs")
    with pytest.raises(ImageRejected):
        orchard_client.create("relative/path")
    with orchard_client.create() as still_fine:
        assert still_fine.exec("echo ok").stdout == "ok\n"
