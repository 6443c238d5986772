"""A host uid/gid of its own for every sandbox (root agents), as user-namespaced container
runtimes give each container its own range.

Per-user kernel limits (inotify instances and watches, user namespaces, pending signals,
...) are counted per host uid, so sandboxes sharing one uid could exhaust them for each
other. Image trees are unpacked once, owned by the first id of the range; a sandbox with
another id sees them through an idmapped mount (``idmapped_view``) that shows them as its
own, so it still owns its image's files as a rootless container does.
"""

from __future__ import annotations

import ctypes
import grp
import os
import pwd
import subprocess
import time
from pathlib import Path
from typing import Optional

_libc = ctypes.CDLL(None, use_errno=True)
_SYS = {"x86_64": (428, 429, 442), "aarch64": (428, 429, 442)}.get(os.uname().machine, (428, 429, 442))
_OPEN_TREE, _MOVE_MOUNT, _MOUNT_SETATTR = _SYS
_OPEN_TREE_CLONE = 1
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x00100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class HostIdPool:
    """Hands out (uid, gid) pairs ``base + n`` for n in [0, count), lowest free first."""

    def __init__(self, base_uid: int, base_gid: int, count: int) -> None:
        self.base_uid, self.base_gid, self.count = base_uid, base_gid, count
        self._used: set[int] = set()

    def take(self) -> Optional[tuple[int, int]]:
        for offset in range(self.count):
            if offset not in self._used:
                self._used.add(offset)
                return self.base_uid + offset, self.base_gid + offset
        return None

    def claim(self, ids: tuple[int, int]) -> None:
        """Mark ``ids`` taken (found in use, e.g. by a job a previous service started)."""
        self._used.add(ids[0] - self.base_uid)

    def release(self, ids: tuple[int, int]) -> None:
        self._used.discard(ids[0] - self.base_uid)


def clashing_accounts(base_uid: int, base_gid: int, count: int) -> list[str]:
    """Accounts and groups of this machine whose ids lie in the sandboxes' ranges: a real
    account there would own sandbox processes and files."""
    users = [f"user {p.pw_name} ({p.pw_uid})" for p in pwd.getpwall() if base_uid <= p.pw_uid < base_uid + count]
    groups = [f"group {g.gr_name} ({g.gr_gid})" for g in grp.getgrall() if base_gid <= g.gr_gid < base_gid + count]
    return users + groups


def _syscall(number: int, *args: object) -> int:
    result = _libc.syscall(number, *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def idmapped_view(source: Path, target: Path, owner: tuple[int, int], shown_as: tuple[int, int]) -> None:
    """Mount ``source`` at ``target`` (read-only use: an overlay's lower layer) so that files
    owned by ``owner`` there appear owned by ``shown_as``."""
    holder = subprocess.Popen(["unshare", "--user", "sleep", "infinity"], stdin=subprocess.DEVNULL)
    try:
        namespace = f"/proc/{holder.pid}/ns/user"
        while os.stat(namespace).st_ino == os.stat("/proc/self/ns/user").st_ino:  # until unshare has run
            if holder.poll() is not None:
                raise OSError(f"unshare --user exited with {holder.returncode}")
            time.sleep(0.001)
        Path(f"/proc/{holder.pid}/uid_map").write_text(f"{owner[0]} {shown_as[0]} 1\n")
        Path(f"/proc/{holder.pid}/setgroups").write_text("deny")
        Path(f"/proc/{holder.pid}/gid_map").write_text(f"{owner[1]} {shown_as[1]} 1\n")
        userns = os.open(namespace, os.O_RDONLY | os.O_CLOEXEC)
    finally:
        if holder.poll() is None:
            holder.kill()
    try:
        tree = _syscall(_OPEN_TREE, _AT_FDCWD, os.fsencode(source), _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE)
        try:
            attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns)
            _syscall(_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
            _syscall(_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH)
        finally:
            os.close(tree)
    finally:
        os.close(userns)
    holder.wait()
