"""Metadata lookups of paths inside a sandbox's root, from the agent.

Only ``O_PATH`` opens: they resolve a path (``openat2(RESOLVE_IN_ROOT)``, so ``..`` and
symlinks planted in the sandbox stay inside it) without opening, reading or writing
anything, so no file's own code runs. Anything that touches content is a file call and
runs inside the sandbox (:mod:`orchard.agent.files`).
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
