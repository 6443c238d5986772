"""Paths inside a sandbox's root, resolved as the sandbox would resolve them, from the agent.

Every path is resolved with ``openat2(RESOLVE_IN_ROOT)``, so ``..`` and symlinks an image
or a sandbox planted stay inside the root (an image whose ``/root`` links to ``/etc``
means the image's ``/etc``, never the host's). Lookups only ``O_PATH``-open, so no file's
own code runs. The preparation helpers (``make_dirs``, ``make_file``, ``chown``) are for
trees no sandbox runs in yet (a fresh writable layer before its container starts); a
sandbox's own file calls run inside it (:mod:`orchard.agent.files`).
"""

from __future__ import annotations

import ctypes
import os

_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _lookup(root: str, path: str, flags: int) -> int:
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(flags | os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(_SYS_OPENAT2, root_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return fd
    finally:
        os.close(root_fd)


def exists_in_root(root: str, path: str, directory: bool = False) -> bool:
    """Whether ``path`` (a directory, when asked) exists inside the sandbox rooted at ``root``."""
    if "\0" in path:
        return False
    try:
        os.close(_lookup(root, path, os.O_DIRECTORY if directory else 0))
        return True
    except OSError:
        return False


def _parent(root: str, path: str) -> tuple[int, str]:
    """(O_PATH fd of the parent directory resolved in root, the last component)."""
    parent, _, name = path.strip("/").rpartition("/")
    if not name or name in (".", ".."):
        raise OSError(22, "not a plain name", path)
    return _lookup(root, "/" + parent, os.O_DIRECTORY), name


def make_dirs(root: str, path: str, mode: int = 0o755) -> None:
    """``mkdir -p`` of ``path`` inside ``root``; an existing entry (even a symlink) is kept."""
    parts = [part for part in path.strip("/").split("/") if part]
    for depth in range(1, len(parts) + 1):
        parent_fd, name = _parent(root, "/".join(parts[:depth]))
        try:
            os.mkdir(name, mode, dir_fd=parent_fd)
        except FileExistsError:
            pass
        finally:
            os.close(parent_fd)


def make_file(root: str, path: str) -> None:
    """An empty file at ``path`` inside ``root`` unless something (even a symlink) is there."""
    parent_fd, name = _parent(root, path)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o644, dir_fd=parent_fd)
        os.close(fd)
    except FileExistsError:
        pass
    finally:
        os.close(parent_fd)


def chown(root: str, path: str, ids: tuple[int, int]) -> None:
    """Give ``path`` (resolved inside ``root``) to ``ids``."""
    fd = _lookup(root, path, 0)
    try:
        os.chown(f"/proc/self/fd/{fd}", *ids)  # the exact inode the in-root lookup found
    finally:
        os.close(fd)
