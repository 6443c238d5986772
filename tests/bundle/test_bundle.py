"""The relocatable agent bundle, for real: built here, run in roots that share nothing
with this machine (no Python, older glibc, no libc at all), through the SDK."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from orchard.bench.measure import count_processes
from orchard.bundle.build import build_bundle
from orchard.bundle.manifest import verify_bundle
from orchard.client.sync import Client
from orchard.errors import InvalidRequest
from tests.bundle.agent_in_root import IMAGE_ENV, bundled_agent
from tests.bundle.roots import root

INJECTOR = Path(__file__).resolve().parents[2] / "docker" / "agent-injector" / "install-bundle.sh"
BUNDLE_ONLY = ("PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE", "LC_CTYPE", "ORCHARD_AGENT_TOKEN")


@pytest.fixture(scope="session")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "orchard"
    build_bundle(out)
    out.parent.chmod(0o755)
    return out


@pytest.mark.parametrize("name", ["bullseye", "bookworm", "busybox"])
def test_bundled_agent_runs_in_a_foreign_root(name, bundle, tmp_path):
    rootfs = root(name)
    assert not list(rootfs.glob("usr/bin/python*")), "the root must have no Python"
    with bundled_agent(rootfs, bundle, tmp_path / "state") as (url, token), Client(url, token) as client:
        sandbox = client.create(image="host")
        release = sandbox.exec("cat /etc/os-release", check=True)
        assert release.stdout == (rootfs / "etc" / "os-release").read_text()
        if name == "busybox":
            assert not (rootfs / "bin" / "bash").exists()
            assert "Linux" in sandbox.exec("busybox uname -a", check=True).stdout

        # Commands see the image's environment as it is, none of the bundle's own.
        env = dict(line.split("=", 1) for line in sandbox.exec("env", check=True).stdout.splitlines() if "=" in line)
        assert env["PYTHONPATH"] == IMAGE_ENV["PYTHONPATH"]
        assert env["LD_LIBRARY_PATH"] == IMAGE_ENV["LD_LIBRARY_PATH"]
        assert not set(BUNDLE_ONLY) & set(env), env

        # A timeout kills the whole process tree, background children included.
        marker = f"{1000 + hash(name) % 9000}"
        job = sandbox.exec(f"sleep {marker}1 & sleep {marker}2", timeout=1)
        assert job.status == "failed" and job.error_type == "timeout"
        deadline = time.monotonic() + 5
        while count_processes(f"sleep {marker}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert count_processes(f"sleep {marker}") == 0

        payload = bytes(range(256)) * 4096
        sandbox.upload("/tmp/payload.bin", payload)
        assert sandbox.download("/tmp/payload.bin") == payload
        assert sandbox.exec("wc -c < /tmp/payload.bin", check=True).stdout.strip() == str(len(payload))
        sandbox.delete()


def test_conda_style_image_path_from_bashrc_with_login_shell(bundle, tmp_path):
    conda, home = tmp_path / "conda", tmp_path / "home"
    (conda / "bin").mkdir(parents=True)
    home.mkdir()
    tool = conda / "bin" / "condatool"
    tool.write_text("#!/bin/sh\necho conda-python-here\n")
    tool.chmod(0o755)
    (home / ".bashrc").write_text('export PATH="/opt/conda/bin:$PATH"\n')
    binds = {"/opt/conda": conda, "/root": home}
    with bundled_agent(root("bookworm"), bundle, tmp_path / "state", binds) as (url, token), \
            Client(url, token) as client:
        sandbox = client.create(image="host")
        assert sandbox.exec("condatool").exit_code == 127
        job = sandbox.exec("condatool", login_shell=True, check=True)
        assert job.stdout.strip() == "conda-python-here"


def test_launcher_refuses_another_architecture_clearly(bundle):
    if not shutil.which("setarch"):
        pytest.fail("setarch (util-linux) is needed to present another architecture")
    result = subprocess.run(["setarch", "i686", str(bundle / "bin" / "orchard-agent"), "--version"],
                            capture_output=True, text=True)
    assert result.returncode == 126
    assert "built for x86_64, but this machine is i686" in result.stderr


def test_launcher_runs_from_any_path_with_an_empty_environment(bundle, tmp_path):
    moved = tmp_path / "somewhere" / "else"
    shutil.copytree(bundle, moved, symlinks=True)
    result = subprocess.run([str(moved / "bin" / "orchard-agent"), "--version"], env={}, capture_output=True,
                            text=True, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("orchard-agent ")


def test_same_inputs_same_bundle_and_manifest_catches_changes(bundle, tmp_path):
    again = build_bundle(tmp_path / "again")
    manifest = json.loads((bundle / "orchard-bundle.json").read_text())
    assert again["digest"] == manifest["digest"]
    assert manifest["size"] <= 80e6, f"bundle is {manifest['size'] / 1e6:.1f} MB"
    assert manifest["inputs"]["arch"] == "x86_64" and "fastapi" in manifest["inputs"]["distributions"]
    assert verify_bundle(tmp_path / "again")["digest"] == again["digest"]
    victim = tmp_path / "again" / "python" / "lib" / "python3.11" / "site-packages" / "orchard" / "__init__.py"
    victim.write_text(victim.read_text() + "# tampered\n")
    with pytest.raises(InvalidRequest, match="changed: python/lib/python3.11/site-packages/orchard/__init__.py"):
        verify_bundle(tmp_path / "again")
    with pytest.raises(InvalidRequest, match="not empty"):
        build_bundle(tmp_path / "again")


@pytest.mark.parametrize("shell", ["busybox", "dash"])
def test_injector_copies_a_verified_bundle_into_the_volume(bundle, tmp_path, shell):
    volume = tmp_path / "volume"
    volume.mkdir()
    env = {"ORCHARD_BUNDLE_SOURCE": str(bundle), "PATH": "/usr/bin:/bin"}
    argv = ["dash", str(INJECTOR), str(volume)]
    if shell == "busybox":  # as in the injector image: busybox's sh, cp and sha256sum; the default source
        argv = ["bwrap", "--ro-bind", str(root("busybox")), "/", "--ro-bind", str(bundle), "/orchard-bundle",
                "--ro-bind", str(INJECTOR.parent), "/injector", "--bind", str(volume), "/orchard", "--proc", "/proc",
                "--dev", "/dev", "--tmpfs", "/tmp", "--clearenv", "--setenv", "PATH", "/bin",
                "/bin/sh", f"/injector/{INJECTOR.name}", "/orchard"]
    first = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    assert verify_bundle(volume)["digest"] == verify_bundle(bundle)["digest"]
    assert not list(volume.glob(".incoming-*"))
    again = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "already holds this bundle" in again.stdout
    version = subprocess.run([str(volume / "bin" / "orchard-agent"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0, version.stderr


def test_injector_refuses_a_corrupt_bundle(bundle, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(bundle, corrupt, symlinks=True)
    (corrupt / "lib" / "libc.so.6").write_bytes(b"not a libc")
    volume = tmp_path / "volume"
    result = subprocess.run(["dash", str(INJECTOR), str(volume)], capture_output=True, text=True,
                            env={"ORCHARD_BUNDLE_SOURCE": str(corrupt), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1 and "does not match SHA256SUMS" in result.stderr
    assert not (volume / "orchard-bundle.json").exists()
