"""Root filesystems that share nothing with this machine, cached between test runs.

- ``bullseye``: debootstrap minbase, glibc 2.31, no Python;
- ``bookworm``: debootstrap minbase;
- ``busybox``: busybox-static alone (no libc, no bash).

They live in ``$ORCHARD_TEST_ROOTS`` (default /var/cache/orchard-test-roots), outside the
repository, and are built when missing (debootstrap: about 40 s each). Each gets the mount
points the tests bind onto (it is mounted read-only, so the cache stays pristine).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

ROOTS = Path(os.environ.get("ORCHARD_TEST_ROOTS", "/var/cache/orchard-test-roots"))
MIRROR = os.environ.get("ORCHARD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
MOUNT_POINTS = ("opt/orchard", "opt/conda", "orchard-state", "orchard-bundle", "orchard", "injector", "root", "tmp",
                "proc", "dev")
BUSYBOX = Path("/bin/busybox")


def _debootstrap(suite: str, target: Path) -> None:
    subprocess.run(["debootstrap", "--variant=minbase", suite, str(target), MIRROR], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _busybox(target: Path) -> None:
    (target / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, target / "bin" / "busybox")
    applets = subprocess.run([str(BUSYBOX), "--list"], check=True, capture_output=True, text=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (target / "bin" / applet).symlink_to("busybox")
    (target / "etc").mkdir()
    (target / "etc" / "os-release").write_text('NAME="Orchard busybox test root"\nID=busybox\n')


def root(name: str) -> Path:
    """The cached root ``name``, built first if missing."""
    ROOTS.mkdir(parents=True, exist_ok=True)
    target = ROOTS / name
    with open(ROOTS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".complete").exists():
            staging = ROOTS / f".{name}.building"
            shutil.rmtree(staging, ignore_errors=True)
            if name == "busybox":
                _busybox(staging)
            else:
                _debootstrap(name, staging)
            (staging / ".complete").touch()
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        for point in MOUNT_POINTS:  # also in roots cached by an older version of this file
            (target / point).mkdir(parents=True, exist_ok=True)
    return target
