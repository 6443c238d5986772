"""Snapshots: a sandbox's writable layer, frozen, that new sandboxes fork from.

A snapshot is the upper directory of a stopped sandbox's overlay, kept where it was
written (its tmpfs moves with it, nothing is copied) and handed to the image owner. A
fork is an ordinary sandbox whose overlay has the snapshot's layers (newest first) above
the image, seen through the same idmapped mount as the image, under a fresh upper layer
of its own. A snapshot of a fork stacks one more layer. A snapshot stays while anything
uses it (its forks, the snapshots taken of them); deleting it then only marks it, and the
last user to go removes it. Snapshots live in the agent's state directory and die with
the agent, as its sandboxes do.
"""

from __future__ import annotations

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

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.snapshots: dict[str, SnapshotState] = {}

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

    def check_depth(self, parent: Optional[SnapshotState]) -> None:
        if parent is not None and len(parent.layers) >= MAX_LAYERS:
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
        if not remove_tree(snapshot.directory):
            log.warning("snapshot %s left on disk: %s", snapshot.snapshot_id, snapshot.directory)
        if snapshot.parent is not None:
            self.drop(snapshot.parent, f"snapshot:{snapshot.snapshot_id}")

    def list(self) -> list[Snapshot]:
        return [s.to_model() for s in self.snapshots.values() if not s.deleting]


def hand_over(top: Path, old: tuple[int, int], new: tuple[int, int]) -> int:
    """Give every entry of a frozen layer owned by ``old`` (the sandbox's host ids) to
    ``new`` (the image owner), without following a symlink and by file descriptor (the
    tree was written by hostile code: paths may be longer than PATH_MAX). Returns the bytes
    the layer holds. The sandbox is stopped: nothing changes the tree meanwhile."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    size = 0
    stack: list[tuple[int, list[str]]] = []

    def enter(fd: int) -> None:
        nonlocal size
        info = os.fstat(fd)
        if (info.st_uid, info.st_gid) == old:
            os.fchown(fd, *new)
        names = []
        with os.scandir(fd) as entries:
            for entry in entries:
                info = entry.stat(follow_symlinks=False)
                size += info.st_blocks * 512
                if stat.S_ISDIR(info.st_mode):
                    names.append(entry.name)
                elif (info.st_uid, info.st_gid) == old:
                    os.chown(entry.name, *new, dir_fd=fd, follow_symlinks=False)
        if len(stack) >= MAX_TREE_DEPTH:
            os.close(fd)
            raise QuotaExceeded(f"the sandbox's files nest deeper than {MAX_TREE_DEPTH} directories; "
                                "cannot snapshot it")
        stack.append((fd, names))

    enter(os.open(top, flags))
    try:
        while stack:
            fd, names = stack[-1]
            if not names:
                os.close(fd)
                stack.pop()
                continue
            enter(os.open(names.pop(), flags, dir_fd=fd))
    finally:
        for fd, _ in stack:
            os.close(fd)
    return size
