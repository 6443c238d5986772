"""Snapshots: a sandbox's writable layer, frozen, that new sandboxes fork from.

A snapshot is the upper directory of a stopped sandbox's overlay, kept where it was
written (its tmpfs moves with it), handed to the image owner and made unwritable for good
(``frozen_layers``). A fork is an ordinary sandbox whose overlay has the snapshot's layers
(newest first) above the image, seen through the same idmapped mount as the image, under
a fresh upper layer of its own. A snapshot of a fork stacks one more layer. A snapshot
stays while anything uses it (its forks, the snapshots taken of them); deleting it then
only marks it, and the last user to go removes it. Snapshots live in the agent's state
directory and die with the agent, as its sandboxes do.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from orchard.agent.runtimes.mounts import remove_tree
from orchard.errors import QuotaExceeded, SandboxConflict, SnapshotNotFound
from orchard.models import Snapshot

log = logging.getLogger("orchard.agent")
MAX_LAYERS = 32  # overlayfs takes up to 500 lower layers, but the mount options must fit in a page
MAX_TREE_DEPTH = 2048  # a frozen layer deeper than this is refused (the hand-over walk keeps a fd per level)


@dataclass
class PendingSnapshot:
    """A snapshot being taken: counted against the limits from the moment it is asked for."""

    sandbox_id: str
    requests: int = 1  # the same request repeated while the first runs (it then returns the first's)
    size_bytes: int = 0  # the sandbox's layer when it was measured, before freezing


@dataclass
class SnapshotState:
    snapshot_id: str
    sandbox_id: str
    image: str
    directory: Path  # owns the frozen layer (and its tmpfs, when the sandbox had a disk quota)
    layers: list[Path]  # this snapshot's layer first, then its parent's
    parent: Optional["SnapshotState"] = None
    size_bytes: int = 0
    created_at: float = field(default_factory=time.time)
    users: set[str] = field(default_factory=set)  # sandboxes forked from it, snapshots stacked on it
    deleting: bool = False

    def to_model(self) -> Snapshot:
        return Snapshot(snapshot_id=self.snapshot_id, sandbox_id=self.sandbox_id, image=self.image,
                        parent=self.parent.snapshot_id if self.parent else None, created_at=self.created_at,
                        size_bytes=self.size_bytes, forks=len(self.users), deleting=self.deleting)


class SnapshotStore:
    """The agent's snapshots and who uses them."""

    def __init__(self, directory: Path, max_snapshots: int = 1000, max_bytes: int = 8 << 30) -> None:
        self.directory = directory
        self.max_snapshots = max_snapshots
        self.max_bytes = max_bytes
        self.snapshots: dict[str, SnapshotState] = {}
        self.pending: dict[str, PendingSnapshot] = {}

    def clean_leftovers(self) -> None:
        """A previous agent's snapshots died with it (their forks did too)."""
        self.directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)
        for entry in self.directory.iterdir():
            remove_tree(entry)

    def get(self, snapshot_id: str) -> SnapshotState:
        snapshot = self.snapshots.get(snapshot_id)
        if snapshot is None or snapshot.deleting:
            raise SnapshotNotFound(f"snapshot {snapshot_id!r} not found")
        return snapshot

    def existing(self, snapshot_id: str, sandbox_id: str) -> Optional[SnapshotState]:
        """The snapshot a repeated request with this id already took, if any (idempotent)."""
        snapshot = self.snapshots.get(snapshot_id)
        if snapshot is None:
            return None
        if snapshot.sandbox_id != sandbox_id or snapshot.deleting:
            raise SandboxConflict(f"snapshot id {snapshot_id!r} is already in use; pick another")
        return snapshot

    def reserve(self, snapshot_id: str, sandbox_id: str, parent: Optional[SnapshotState]) -> None:
        """Count a snapshot about to be taken, before its request waits for anything (so
        requests arriving together see each other): its id is this sandbox's, and
        ``max_snapshots`` and the depth hold with every snapshot under way counted.
        ``release`` it when the request ends, however it ends."""
        pending = self.pending.get(snapshot_id)
        if pending is not None:
            if pending.sandbox_id != sandbox_id:
                raise SandboxConflict(f"snapshot id {snapshot_id!r} is already in use; pick another")
            pending.requests += 1
            return
        under_way = [p for sid, p in self.pending.items() if sid not in self.snapshots]
        if len(self.snapshots) + len(under_way) >= self.max_snapshots:
            raise QuotaExceeded(f"this agent already keeps {len(self.snapshots)} snapshots and takes {len(under_way)} "
                                "(max_snapshots); delete some")
        self.check_depth(parent, sum(p.sandbox_id == sandbox_id for p in under_way))
        self.pending[snapshot_id] = PendingSnapshot(sandbox_id)

    def reserve_bytes(self, snapshot_id: str, size: int) -> None:
        """Count ``size`` bytes for a reserved snapshot, measured before freezing: refused when
        the snapshots kept (deleted ones still used included) and those under way would hold
        more than ``max_snapshot_bytes``. Their memory is nobody's sandbox's any more."""
        held = sum(s.size_bytes for s in self.snapshots.values())
        held += sum(p.size_bytes for sid, p in self.pending.items() if sid != snapshot_id and sid not in self.snapshots)
        if held + size > self.max_bytes:
            raise QuotaExceeded(f"snapshots would hold {held + size} bytes ({held} already), more than "
                                f"max_snapshot_bytes ({self.max_bytes}); delete some")
        self.pending[snapshot_id].size_bytes = size

    def release(self, snapshot_id: str) -> None:
        pending = self.pending.get(snapshot_id)
        if pending is not None:
            pending.requests -= 1
            pending.size_bytes = 0  # taken (then counted as a snapshot) or not: no longer under way
            if pending.requests <= 0:
                del self.pending[snapshot_id]

    def check_depth(self, parent: Optional[SnapshotState], under_way: int = 0) -> None:
        """A snapshot on ``parent`` (after ``under_way`` more of the same sandbox) stacks at most MAX_LAYERS."""
        if (len(parent.layers) if parent is not None else 0) + under_way >= MAX_LAYERS:
            raise QuotaExceeded(f"snapshots stack at most {MAX_LAYERS} deep; fork from an earlier snapshot")

    def add(self, snapshot: SnapshotState) -> None:
        self.snapshots[snapshot.snapshot_id] = snapshot
        if snapshot.parent is not None:
            self.use(snapshot.parent, f"snapshot:{snapshot.snapshot_id}")

    def use(self, snapshot: SnapshotState, user: str) -> None:
        snapshot.users.add(user)

    def drop(self, snapshot: SnapshotState, user: str) -> None:
        """``user`` no longer needs ``snapshot``: remove it if it was deleted meanwhile."""
        snapshot.users.discard(user)
        if snapshot.deleting and not snapshot.users:
            self._remove(snapshot)

    def delete(self, snapshot_id: str) -> None:
        snapshot = self.get(snapshot_id)
        snapshot.deleting = True
        if not snapshot.users:
            self._remove(snapshot)

    def delete_all(self) -> None:
        for snapshot in list(self.snapshots.values()):
            snapshot.users.clear()
            snapshot.deleting = True
            self._remove(snapshot)

    def _remove(self, snapshot: SnapshotState) -> None:
        if self.snapshots.pop(snapshot.snapshot_id, None) is None:
            return
        try:
            removed = remove_tree(snapshot.directory)
        except Exception:  # never fails the delete of the sandbox or snapshot that let it go
            log.exception("removing snapshot %s failed", snapshot.snapshot_id)
            removed = False
        if not removed:
            log.warning("snapshot %s left on disk: %s", snapshot.snapshot_id, snapshot.directory)
        if snapshot.parent is not None:
            self.drop(snapshot.parent, f"snapshot:{snapshot.snapshot_id}")

    def list(self) -> list[Snapshot]:
        return [s.to_model() for s in self.snapshots.values() if not s.deleting]


INODE_BYTES = 1024  # what an inode pins beside its data (tmpfs counts each as BOGO_INODE_SIZE)


def hand_over(top: Path, old: tuple[int, int], new: tuple[int, int]) -> int:
    """Give every entry of a frozen layer owned by ``old`` (the sandbox's host ids) to
    ``new`` (the image owner), without following a symlink and by file descriptor (the
    tree was written by hostile code: paths may be longer than PATH_MAX). Returns the bytes
    the layer holds (data blocks, and INODE_BYTES an entry: an empty file is not free). The sandbox is stopped; entries that vanish meanwhile (a descriptor
    kept outside it) are skipped."""
    return _walk(top, (old, new))


def tree_size(top: Path) -> int:
    """The bytes a tree holds, walked as ``hand_over`` walks it (QuotaExceeded when it nests
    deeper than MAX_TREE_DEPTH); it may change meanwhile."""
    return _walk(top, None)


def _walk(top: Path, owners: Optional[tuple[tuple[int, int], tuple[int, int]]]) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    size = 0
    stack: list[tuple[int, list[str]]] = []
    old, new = owners if owners is not None else (None, None)

    def enter(fd: int) -> None:
        nonlocal size
        try:
            if len(stack) >= MAX_TREE_DEPTH:
                raise QuotaExceeded(f"the sandbox's files nest deeper than {MAX_TREE_DEPTH} directories; "
                                    "cannot snapshot it")
            info = os.fstat(fd)
            if owners is not None and (info.st_uid, info.st_gid) == old:
                os.fchown(fd, *new)
            names = []
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        info = entry.stat(follow_symlinks=False)
                        if stat.S_ISDIR(info.st_mode):
                            names.append(entry.name)
                        elif owners is not None and (info.st_uid, info.st_gid) == old:
                            os.chown(entry.name, *new, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    size += info.st_blocks * 512 + INODE_BYTES
        except BaseException:
            os.close(fd)
            raise
        stack.append((fd, names))

    enter(os.open(top, flags))
    try:
        while stack:
            fd, names = stack[-1]
            if not names:
                os.close(fd)
                stack.pop()
                continue
            try:
                child = os.open(names.pop(), flags, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:  # replaced by a symlink meanwhile
                    raise
                continue
            enter(child)
    finally:
        for fd, _ in stack:
            os.close(fd)
    return size
