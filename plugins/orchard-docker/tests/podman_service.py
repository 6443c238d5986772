"""Podman's Docker-compatible API service, started for the tests in a scratch directory of
its own (configuration, image store, socket), so nothing here touches the machine's Podman
storage or another test's. Podman 4.3 here needs runc, cgroupfs, file events and default
rlimits at or below this process's own hard limits (shared/notes on Podman)."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Optional

KIT_IMAGE = "localhost/orchard-kit:test"


class PodmanService:
    """One ``podman system service --time=0 unix://DIR/podman.sock``; ``stop`` ends it and
    everything it ran."""

    def __init__(self, root: Optional[Path] = None) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix="odk-", dir="/tmp"))
        self.socket = self.root / "podman.sock"
        self.url = f"unix://{self.socket}"
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        nofile = 65536 if nofile == resource.RLIM_INFINITY else min(nofile, 1 << 20)
        nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
        (self.root / "containers.conf").write_text(
            f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
            '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
            f'[network]\nnetwork_config_dir = "{self.root}/networks"\n')
        (self.root / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{self.root}/storage"\nrunroot = "{self.root}/run"\n')
        self.env = {**os.environ, "CONTAINERS_CONF": str(self.root / "containers.conf"),
                    "CONTAINERS_STORAGE_CONF": str(self.root / "storage.conf")}
        self.env.pop("DOCKER_HOST", None)
        self.process: Optional[subprocess.Popen] = None

    def podman(self, *args: str, timeout: float = 120, stdin: Optional[object] = None) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                              stdin=stdin, cwd=self.root)  # type: ignore[arg-type]

    def start(self, timeout: float = 30.0) -> "PodmanService":
        log = open(self.root / "service.log", "ab")
        self.process = subprocess.Popen(["podman", "system", "service", "--time=0", self.url], env=self.env,
                                        stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                        cwd=self.root)  # conmon writes an 'oom' file into its working directory
        log.close()
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"podman system service did not answer: {(self.root / 'service.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def answers(self) -> bool:
        import docker

        if not self.socket.exists():
            return False
        try:
            api = docker.APIClient(base_url=self.url, version="1.41", timeout=2)
            try:
                return bool(api.ping())
            finally:
                api.close()
        except Exception:
            return False

    def import_directory(self, directory: Path, name: str = KIT_IMAGE) -> str:
        """A directory root filesystem as an engine image (``podman import`` of its tarball)."""
        tarball = self.root / "image.tar"
        with tarfile.open(tarball, "w") as tar:
            tar.add(str(directory), arcname=".")
        result = self.podman("import", str(tarball), name)
        tarball.unlink()
        assert result.returncode == 0, result.stderr
        return name

    def stop(self) -> None:
        """Remove every container first (their conmon processes outlive the service), then end it."""
        if self.process is not None and self.process.poll() is None:
            self.podman("rm", "--all", "--force", "--time", "0")
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def destroy(self) -> None:
        self.stop()
        self.podman("system", "reset", "--force")
        shutil.rmtree(self.root, ignore_errors=True)
