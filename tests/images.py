"""Real images made offline: a busybox root filesystem, and an OCI image of it pushed to
a real registry (Debian's docker-registry) listening on loopback."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

BUSYBOX = "/bin/busybox"


def busybox_rootfs(target: Path) -> Path:
    """A root filesystem holding only a static busybox (no libc, no bash)."""
    bin_dir = target / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, bin_dir / "busybox")
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        link = bin_dir / applet
        if not link.exists():
            link.symlink_to("busybox")
    for name in ("etc", "tmp", "workspace", "root", "app"):
        (target / name).mkdir(exist_ok=True)
    (target / "tmp").chmod(0o1777)
    (target / "etc/os-release").write_text('NAME="orchard-busybox"\nID=busybox\n')
    (target / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    return target


def repository_name(text: str) -> str:
    """A valid OCI repository component from any text: lower-case alphanumerics joined by
    single dashes ("perjob-test-_sxn168a" would be refused by the registry)."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return name or "image"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Registry:
    """docker-registry on 127.0.0.1:<free port>, storage in a scratch directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        config = workdir / "registry.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {workdir / 'storage'}\nhttp:\n  addr: {self.address}\n")
        self.process = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL,
                                        stderr=open(workdir / "registry.log", "wb"))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{self.address}/v2/", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"registry did not start: {(workdir / 'registry.log').read_text()}")

    def push_rootfs(self, rootfs: Path, name: str, env: dict[str, str], workdir: str) -> str:
        """Build an OCI image from ``rootfs`` with umoci and push it; returns docker://REF.
        ``name`` may be anything (a temporary directory's name): it is made a valid repository."""
        name = repository_name(name)
        layout = self.workdir / f"layout-{name}"
        bundle = self.workdir / f"bundle-{name}"
        shutil.rmtree(layout, ignore_errors=True)
        shutil.rmtree(bundle, ignore_errors=True)
        run = lambda *argv: subprocess.run(argv, check=True, capture_output=True)  # noqa: E731
        run("umoci", "init", "--layout", str(layout))
        run("umoci", "new", "--image", f"{layout}:latest")
        run("umoci", "unpack", "--rootless", "--image", f"{layout}:latest", str(bundle))
        shutil.rmtree(bundle / "rootfs")
        shutil.copytree(rootfs, bundle / "rootfs", symlinks=True)
        run("umoci", "repack", "--image", f"{layout}:latest", str(bundle))
        config = ["umoci", "config", "--image", f"{layout}:latest", "--config.workingdir", workdir]
        for key, value in env.items():
            config += ["--config.env", f"{key}={value}"]
        run(*config)
        reference = f"docker://{self.address}/{name}:latest"
        run("skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:latest", reference)
        return reference

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()


def have_image_tools() -> bool:
    return all(shutil.which(tool) for tool in ("docker-registry", "umoci", "skopeo")) and os.path.exists(BUSYBOX)
