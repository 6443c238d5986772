"""Thin wrappers over mount(2)/umount2(2) for writable layers (overlayfs, tmpfs quotas)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2


def mount(source: str, target: Path, fstype: str, options: str) -> None:
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def unmount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: already gone
            raise OSError(err, f"umount {target}: {os.strerror(err)}")
