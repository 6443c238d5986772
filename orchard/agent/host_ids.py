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
import fcntl
import grp
import logging
import os
import pwd
import subprocess
import time
from pathlib import Path
from typing import Optional

_libc = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger("orchard.agent")
_SYS = {"x86_64": (428, 429, 442), "aarch64": (428, 429, 442)}.get(os.uname().machine, (428, 429, 442))
_OPEN_TREE, _MOVE_MOUNT, _MOUNT_SETATTR = _SYS
_OPEN_TREE_CLONE = 1
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x00100000
_MOUNT_ATTR_RDONLY = 0x00000001


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


# Far above what directory services (SSSD maps to 200000..2000200000), subuid allocations
# (100000 + 65536 n) and systemd's container range (up to 1879048191) hand out, and below
# 2^31, where tools with signed ids go wrong. Checked against this machine at start anyway.
DEFAULT_HOST_UID = 2_100_000_000
CLAIMS_DIR = Path("/run/orchard/host-ids")  # ranges agents on this machine hold (flock'ed files)
SUBUID_FILE, SUBGID_FILE = Path("/etc/subuid"), Path("/etc/subgid")


class HostIdPool:
    """Hands out (uid, gid) pairs ``base + n`` for n in [1, count), lowest free first; the
    range's first ids (n = 0) own the unpacked images and are never a sandbox's."""

    def __init__(self, base_uid: int, base_gid: int, count: int) -> None:
        self.base_uid, self.base_gid, self.count = base_uid, base_gid, count
        self._used: set[int] = set()

    def take(self) -> Optional[tuple[int, int]]:
        for offset in range(1, self.count):
            if offset not in self._used:
                self._used.add(offset)
                return self.base_uid + offset, self.base_gid + offset
        return None

    def claim(self, ids: tuple[int, int]) -> None:
        """Mark ``ids`` taken (found in use, e.g. by a job a previous service started)."""
        self._used.add(ids[0] - self.base_uid)

    def release(self, ids: tuple[int, int]) -> None:
        self._used.discard(ids[0] - self.base_uid)


def _subordinate(path: Path) -> list[tuple[int, int, str]]:
    """(start, count, label) of each entry of /etc/subuid or /etc/subgid."""
    found = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            found.append((int(parts[1]), int(parts[2]), f"{path} entry {parts[0]}:{parts[1]}:{parts[2]}"))
    return found


def _machine_ids() -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """Ranges of uids and of gids this machine gives to someone: accounts, groups and
    subordinate ranges (their owner could act as any id in them)."""
    uids = [(p.pw_uid, 1, f"user {p.pw_name} ({p.pw_uid})") for p in pwd.getpwall()] + _subordinate(SUBUID_FILE)
    gids = [(g.gr_gid, 1, f"group {g.gr_name} ({g.gr_gid})") for g in grp.getgrall()] + _subordinate(SUBGID_FILE)
    return uids, gids


def _overlapping(ranges: list[tuple[int, int, str]], start: int, count: int) -> list[str]:
    return [label for low, size, label in ranges if low < start + count and start < low + size]


def clashing_accounts(base_uid: int, base_gid: int, count: int) -> list[str]:
    """Accounts, groups and subordinate id ranges of this machine that overlap the
    sandboxes' ranges: their owner could act as a sandbox's uid (read its files, signal
    its processes, write the images it shares)."""
    uids, gids = _machine_ids()
    return _overlapping(uids, base_uid, count) + _overlapping(gids, base_gid, count)


def _live_claims() -> list[tuple[int, int]]:
    """(first uid, count) of the ranges live agents hold; stale claim files are removed."""
    live = []
    for path in CLAIMS_DIR.glob("*.claim"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)  # nobody holds it: its agent is gone
        except BlockingIOError:
            start, _, count = path.stem.partition("-")
            live.append((int(start), int(count)))
        finally:
            os.close(fd)
    return live


def claim_host_ids(uid: int, gid: int, count: int, search: int = 1) -> tuple[int, int, int]:
    """Claim ``count`` host ids from (uid, gid) for as long as this process lives (a lock
    file under /run), so two agents on one machine never hand out the same ids. With
    ``search`` > 1 the next ranges of the same size are tried when one is taken or clashes
    with an account. Returns (uid, gid, the claim's fd: keep it open)."""
    try:
        CLAIMS_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(CLAIMS_DIR, 0o700)  # only root agents claim: no user may lock a claim or the guard
        guard = os.fdopen(os.open(CLAIMS_DIR / ".guard", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  0o600), "w")
    except OSError as exc:  # a read-only /run (inside a container): no other agent shares it
        clashes = clashing_accounts(uid, gid, count)
        if clashes:
            raise OSError(f"sandbox host ids {uid}..{uid + count - 1} include {', '.join(clashes[:3])}: set "
                          "host_uid/host_gid to a range no account uses") from None
        log.warning("cannot claim host ids under %s (%s): assuming this agent is alone here", CLAIMS_DIR, exc)
        return uid, gid, os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    with guard:
        deadline = time.monotonic() + 30
        while True:  # never wait forever on whoever holds the guard
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(f"{CLAIMS_DIR}/.guard stayed locked for 30 s") from None
                time.sleep(0.05)
        live = _live_claims()
        uids, gids = _machine_ids()
        reasons = []
        for k in range(search):
            start_uid, start_gid = uid + k * count, gid + k * count
            taken = [(s, c) for s, c in live if s < start_uid + count and start_uid < s + c]
            clashes = _overlapping(uids, start_uid, count) + _overlapping(gids, start_gid, count)
            if taken or clashes:
                reasons.append(f"{start_uid}..{start_uid + count - 1}: "
                               + ", ".join([*(f"held by another agent ({s}..{s + c - 1})" for s, c in taken),
                                            *clashes][:3]))
                continue
            fd = os.open(CLAIMS_DIR / f"{start_uid}-{count}.claim",
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{os.getpid()}\n".encode())
            return start_uid, start_gid, fd
    raise OSError(f"no free range of {count} sandbox host ids from {uid}: {'; '.join(reasons[:3])}; "
                  "set host_uid/host_gid to a range no account, subordinate range or other agent uses")


def _syscall(number: int, *args: object) -> int:
    result = _libc.syscall(number, *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def idmapped_view(source: Path, target: Path, owner: tuple[int, int], shown_as: tuple[int, int]) -> None:
    """Mount ``source`` at ``target`` (read-only use: an overlay's lower layer) so that files
    owned by ``owner`` there appear owned by ``shown_as``."""
    idmapped_views([(source, target)], owner, shown_as)


def idmapped_views(pairs: list[tuple[Path, Path]], owner: tuple[int, int], shown_as: tuple[int, int]) -> None:
    """``idmapped_view`` for several (source, target) pairs with one user namespace (a fork's
    snapshot layers and its image share the owner, so one namespace serves them all)."""
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
        for source, target in pairs:
            tree = _syscall(_OPEN_TREE, _AT_FDCWD, os.fsencode(source), _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE)
            try:
                attr = _MountAttr(_MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY, 0, 0, userns)  # a lower layer: never written
                _syscall(_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, ctypes.byref(attr),
                         ctypes.sizeof(attr))
                _syscall(_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH)
            finally:
                os.close(tree)
    finally:
        os.close(userns)
    holder.wait()
