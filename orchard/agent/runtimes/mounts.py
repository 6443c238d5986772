"""Thin wrappers over mount(2)/umount2(2) for writable layers (overlayfs, tmpfs quotas)."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
_ESCAPED = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, backslash as \ooo
log = logging.getLogger("orchard.agent")

# Host-global /proc entries hidden inside sandboxes, as container runtimes mask them
# (an empty file or directory on top); /proc/sys is read-only.
MASKED_PROC_FILES = ("kcore", "kallsyms", "keys", "latency_stats", "sched_debug", "sysrq-trigger", "timer_list",
                     "timer_stats", "kpagecount", "kpageflags", "kpagecgroup", "config.gz")
MASKED_PROC_DIRS = ("acpi", "asound", "scsi", "firmware", "driver")


# Read-only host system directories a bubblewrap root may show (the ``host`` image, and the
# confined copy of a directory image); nothing else of the host.
HOST_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def system_binds() -> list[str]:
    """bubblewrap arguments showing the host's system directories read-only (merged-/usr
    symlinks as symlinks)."""
    args: list[str] = []
    for path in HOST_SYSTEM_PATHS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def mount(source: str, target: Path, fstype: str, options: str) -> None:
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def unmount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: already gone
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mounts_below(path: Path) -> list[Path]:
    """Mount points at or below ``path`` in our mount namespace, deepest first."""
    top = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = _ESCAPED.sub(lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point == top or point.startswith(top.rstrip("/") + "/"):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def remove_tree(path: Path) -> bool:
    """``rm -rf`` that never descends into a mount: whatever is mounted below ``path`` (a
    sandbox's overlay, its tmpfs, an idmapped view of a shared image) is detached first,
    and a tree that still holds a mount is left as it is. False when it was left."""
    for point in mounts_below(path):
        try:
            unmount(point)
        except OSError as exc:
            log.warning("cannot unmount %s: %s", point, exc)
    remaining = mounts_below(path)
    if remaining:
        log.warning("left %s in place: still mounted below it: %s", path, ", ".join(map(str, remaining)))
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
