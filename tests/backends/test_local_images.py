"""Images on the local backend: root-filesystem directories and docker:// from a real registry."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from pathlib import Path

import pytest

from orchard.errors import FileOperationFailed, ImageRejected
from tests.backends.test_local_isolation import host_uid_of
from tests.images import Registry, busybox_rootfs, have_image_tools

@pytest.fixture(scope="module", autouse=True)
def image_tools():
    """Fail (never skip) without the image tools, as the Slurm tests do: make system-deps installs them."""
    if not have_image_tools():
        pytest.fail("needs docker-registry, umoci, skopeo and busybox-static: run `make system-deps` "
                    "(apt-get install docker-registry umoci skopeo busybox-static)")


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
    cached = [p.name for p in agent_settings.images_dir.glob("*/sha256-*")]  # below the owner's uid
    assert len(cached) == 1


def test_missing_image_is_a_clear_error(orchard_client, registry):
    with pytest.raises(ImageRejected, match="cannot be pulled"):
        orchard_client.create(f"docker://{registry.address}/no-such-image:latest")
    with pytest.raises(ImageRejected, match="does not exist"):
        orchard_client.create("/tmp/no/such/rootfs")
    with pytest.raises(ImageRejected):
        orchard_client.create("relative/path")
    with orchard_client.create() as still_fine:
        assert still_fine.exec("echo ok").stdout == "ok\n"


def test_directory_images_come_only_from_the_configured_directories(orchard_client, agent_settings):
    """Any API-key holder could read host files through a directory image ("/etc") or the
    agent's master token through its own state directory."""
    for image in ("/etc", "dir:///etc", "/", "/root", str(agent_settings.agent_dir), str(agent_settings.state_dir),
                  f"dir://{agent_settings.sandboxes_dir}"):
        with pytest.raises(ImageRejected, match="refused by policy"):
            orchard_client.create(image)


def test_directory_images_in_the_rootfs_directory_are_allowed_by_default(agent_settings):
    from orchard.agent.image_policy import orchard_verify_image

    policy = agent_settings.model_copy(update={"image_dirs": []}).image_policy()
    assert orchard_verify_image(str(agent_settings.rootfs_dir / "debian"), policy) is None
    assert "image_dirs" in orchard_verify_image("/tmp/some-root", policy)
    escape = agent_settings.rootfs_dir / "escape"
    escape.symlink_to("/etc")
    try:
        assert orchard_verify_image(str(escape), policy) is not None  # resolved before it is judged
    finally:
        escape.unlink()


def test_registries_come_from_an_allow_list(orchard_client):
    """docker://127.0.0.1:PORT/... let a caller probe the agent's internal ports."""
    for image in ("docker://10.0.0.1:2375/x:latest", "docker://metadata.internal/x", "docker://evil.example/x"):
        with pytest.raises(ImageRejected, match="not in the allowed registries"):
            orchard_client.create(image)


def test_registry_names_are_read_as_docker_reads_them():
    from orchard.agent.image_policy import DEFAULT_REGISTRIES, registry_allowed, registry_of

    assert registry_of("docker://ubuntu:22.04") == "docker.io"
    assert registry_of("docker://library/ubuntu") == "docker.io"
    assert registry_of("docker://ghcr.io/org/img@sha256:abc") == "ghcr.io"
    assert registry_of("docker://127.0.0.1:5000/img") == "127.0.0.1:5000"
    assert registry_of("docker://localhost/img") == "localhost"
    assert registry_allowed("docker.io", list(DEFAULT_REGISTRIES))
    assert not registry_allowed("127.0.0.1:5000", list(DEFAULT_REGISTRIES))
    assert registry_allowed("127.0.0.1:5000", ["127.0.0.1"]) and not registry_allowed("127.0.0.1:5000", ["127.0.0.1:6000"])
    assert registry_allowed("anything.example", ["*"])


def test_image_files_stay_the_sandbox_users_under_its_own_uid(orchard_client, busybox_dir):
    """Images are unpacked once for the first id; other sandboxes see them through an
    idmapped mount, as their own."""
    with orchard_client.create(str(busybox_dir)) as first, orchard_client.create(str(busybox_dir)) as second:
        assert host_uid_of(first) != host_uid_of(second)
        for sandbox in (first, second):
            assert sandbox.exec("stat -c %u /etc/os-release; id -u").stdout.split() == ["1000", "1000"]
            assert sandbox.exec("echo changed > /etc/os-release && cat /etc/os-release").stdout == "changed\n"


def _swap_on_open(watched: Path, first: Path, second: Path, done: threading.Event) -> None:
    """When ``watched`` is opened, exchange ``first`` and ``second`` (renameat2 RENAME_EXCHANGE):
    the race a local user with write access to an image directory can run against an import."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    libc.inotify_add_watch(fd, str(watched).encode(), 0x20)  # IN_OPEN
    os.read(fd, 4096)
    libc.renameat2(-100, str(first).encode(), -100, str(second).encode(), 2)  # RENAME_EXCHANGE
    os.close(fd)
    done.set()


def test_an_image_directory_swapped_for_a_symlink_mid_import_copies_nothing_of_the_host(orchard_client, scratch):
    """The import used to copy by path as root: swapping the image directory for a symlink
    to / while cp was busy with a large file put the host's /etc/shadow in the image."""
    images = scratch / "race"
    images.mkdir()
    image = images / "image"
    image.mkdir()
    (image / "a-large-file").write_bytes(b"\0" * (64 << 20))  # copied first: the window
    for name in ("etc", "root", "workspace", "tmp"):
        (image / name).mkdir()
    (images / "decoy").symlink_to("/")
    done = threading.Event()
    watcher = threading.Thread(target=_swap_on_open, args=(image / "a-large-file", image, images / "decoy", done),
                               daemon=True)
    watcher.start()
    try:
        with orchard_client.create(str(image)) as sandbox:
            assert done.wait(30), "the import never opened the large file"
            for secret in ("/etc/shadow", "/root/.bashrc", "/etc/hostname"):
                with pytest.raises(FileOperationFailed):
                    sandbox.download(secret)
    except ImageRejected:
        pass  # refusing the swapped directory is as good
    assert done.is_set()


def test_what_was_inspected_is_what_is_pulled_even_if_the_tag_moves(registry, scratch):
    """The cache is keyed by the digest ``skopeo inspect`` gave; the pull then asks for that
    digest, not the tag: a tag moved in between must not put other content under that key."""
    import asyncio

    from orchard.agent.images import ImageStore
    from orchard.agent.reaper import ChildReaper

    first, second = busybox_rootfs(scratch / "tag-first"), busybox_rootfs(scratch / "tag-second")
    (first / "etc" / "which").write_text("first\n")
    (second / "etc" / "which").write_text("second\n")

    async def main() -> str:
        reaper = ChildReaper()
        reaper.install(asyncio.get_running_loop())
        store = ImageStore(scratch / "tag-cache", None, {"insecure_registries": ["127.0.0.1"]}, reaper)
        reference = registry.push_rootfs(first, "moving", env={}, workdir="/")
        digest = await store._digest(reference)  # inspected: the first content
        registry.push_rootfs(second, "moving", env={}, workdir="/")  # the tag moves before the pull
        target = scratch / "tag-cache" / digest.replace(":", "-")
        await store._unpack(reference, digest, target)
        return (target / "rootfs" / "etc" / "which").read_text()

    assert asyncio.run(main()) == "first\n"


def test_tls_is_off_only_for_the_registry_skopeo_will_contact():
    """``docker://localhost:5000`` (no path) is docker.io's ``library/localhost`` with tag 5000:
    TLS stays on for it (it was turned off: a review found it)."""
    from orchard.agent.images import ImageStore

    store = ImageStore.__new__(ImageStore)
    store.insecure_registries = ["localhost", "127.0.0.1"]
    assert store._tls_flag("docker://localhost:5000", "tls-verify") == []
    assert store._tls_flag("docker://127.0.0.1", "tls-verify") == []
    assert store._tls_flag("docker://localhost:5000/img:1", "tls-verify") == ["--tls-verify=false"]
    assert store._tls_flag("docker://127.0.0.1:5000/img", "tls-verify") == ["--tls-verify=false"]
