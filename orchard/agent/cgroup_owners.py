"""Which agent owns which cgroup tree, so trees of agents that died can be removed.

Each agent keeps its sandboxes' cgroups under ``<hierarchy>/orchard/<agent name>``. An
agent stopped cleanly removes its tree, and one restarted on the same state directory
removes what its predecessor left; but an agent that is never restarted (a Slurm pilot
killed by ``scancel`` or its time limit, each with a state directory of its own) left its
tree for good: the dev cluster here had gathered 99 of them. So a live agent holds an
exclusive ``flock`` on ``/run/orchard/cgroup-owners/<agent name>``; the kernel drops it when
the agent dies, however it dies, and the next agent to start on the host removes every tree
whose lock it can take and in which no process is left. A tree with no lock file (an agent
of an older version) is left alone, and nothing is ever killed: only empty trees whose owner
is known to be dead are removed. Pilots keep their trees below their own job's cgroup
(``.../job_N/.../orchard/<agent name>``) and claim them the same way: a pilot killed outright
left its tree there, which kept Slurm from removing the job's cgroup; the next pilot on the
node removes it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger(__name__)

OWNERS_DIR = Path("/run/orchard/cgroup-owners")
HOLD_PATIENCE = 5.0  # seconds to wait for a lock another agent's sweep holds for a moment


def _lock(path: Path, patience: float) -> Optional[int]:
    """An open descriptor holding ``path``'s exclusive lock, or None when it stays held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.05)


class CgroupOwnership:
    """This agent's claim on its tree, and the removal of trees whose owners died."""

    def __init__(self, agent_name: str, directory: Path = OWNERS_DIR) -> None:
        self.agent_name = agent_name
        self.directory = directory
        self._fd: Optional[int] = None

    def hold(self) -> bool:
        """Claim this agent's tree for as long as this process lives."""
        path = self.directory / self.agent_name
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            for _ in range(3):  # a sweep may unlink the file between our open and our lock
                self._fd = _lock(path, HOLD_PATIENCE)
                if self._fd is None or os.fstat(self._fd).st_ino == os.stat(path).st_ino:
                    break
                self.release()
        except OSError as exc:
            log.warning("cgroups: cannot mark this agent's tree as owned (%s); a later agent will not remove it "
                        "should this one die", exc)
            return False
        if self._fd is None:
            log.warning("cgroups: another live agent holds %s; is a second agent running on this state directory?",
                        self.directory / self.agent_name)
        return self._fd is not None

    def release(self, forget: bool = False) -> None:
        """Let go of the claim; ``forget``: also remove the lock file (the tree is gone)."""
        if self._fd is not None:
            if forget:
                try:
                    os.unlink(self.directory / self.agent_name)
                except OSError:
                    pass
            os.close(self._fd)
            self._fd = None

    def remove_orphans(self, parents: list[Path], remove_tree: Callable[[Path], bool]) -> list[str]:
        """Remove the trees under each of ``parents`` (a hierarchy's ``orchard`` directory) of
        agents whose lock is free, with ``remove_tree`` (True once a tree is gone). Returns
        the names of the agents whose trees are all gone."""
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            return []
        removed = []
        for name in names:
            if name == self.agent_name:
                continue
            try:
                fd = _lock(self.directory / name, 0)
            except OSError:
                continue
            if fd is None:
                continue  # its agent lives
            try:
                trees = [parent / name for parent in parents if (parent / name).is_dir()]
                if all(remove_tree(tree) for tree in trees):
                    os.unlink(self.directory / name)
                    removed.append(name)
            finally:
                os.close(fd)
        if removed:
            log.info("cgroups: removed the trees of %d agents that died: %s", len(removed), ", ".join(removed[:10]))
        return removed
