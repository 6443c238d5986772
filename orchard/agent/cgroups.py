"""Per-sandbox cgroups: memory, pids and CPU limits, and a way to kill everything.

cgroup v1 (our machines) and v2 are both handled; where no hierarchy is writable the
sandbox runs without limits and says so in its status message.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from orchard.agent.cgroup_owners import CgroupOwnership

log = logging.getLogger(__name__)

V1_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000


def _read_small(path: Path) -> bytes:
    """One read of a small kernel file (pathlib's read_text costs several times more)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b"?"
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def members(group: Path, listing: str = "cgroup.procs") -> set[int]:
    """The pids in ``group`` (one read of its ``cgroup.procs``, or of ``tasks`` for the
    thread ids; empty if it cannot be read).

    Nothing here moves a process into a group by writing its pid: that takes the kernel's
    global threadgroup lock, which waits for an RCU grace period (about 10 ms) unless the
    hierarchy is mounted with ``favordynmods``. Processes join by writing "0" into the
    group's ``tasks`` themselves (spawner.py, orchard_enter.c), which takes no such lock."""
    return {int(pid) for pid in _read_small(group / listing).split() if pid.isdigit()}


def _walk_bottom_up(root: Path) -> list[Path]:
    return [Path(top) for top, _, _ in os.walk(root, topdown=False)]


@dataclass
class SandboxCgroup:
    """The cgroup directories of one sandbox (one per v1 controller, or one v2 dir).

    With cgroup v1 every command also runs in a child of the sandbox's ``pids`` group
    (``job_dir``), so a timeout can kill all it started, even what left its session;
    a child still holding background processes is not reused.
    """

    dirs: dict[str, Path] = field(default_factory=dict)
    job_controller: Optional[str] = None  # the controller whose tree holds per-job children
    job_dirs: list[Path] = field(default_factory=list)
    oom_kills_seen: int = 0
    reserved: set[Path] = field(default_factory=set)  # claimed, not yet visibly occupied (claim_job_dir)
    job_count: int = 0  # job groups made so far: names are never reused, retired ones included
    retired: set[Path] = field(default_factory=set)  # retired, not yet removed: something was still in them

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def exists(self) -> bool:
        """Whether any of its directories is still there (a removal that gave up)."""
        return any(d.exists() for d in self.dirs.values())

    def job_dir(self) -> Optional[Path]:
        """An empty child group for the next command (None where jobs are not tracked so).

        Groups are reused rather than made and removed per command: creating and removing
        cgroups takes global locks and showed up as 5-10 ms spikes in exec latency.
        """
        if self.job_controller is None:
            return None
        if self.retired:
            self._remove_retired()
        for path in self.job_dirs:
            if path not in self.reserved and not _read_small(path / "cgroup.procs").strip():
                return path
        self.job_count = max(self.job_count, len(self.job_dirs))
        while True:
            path = self.dirs[self.job_controller] / f"job-{self.job_count}"
            self.job_count += 1
            try:
                path.mkdir()
            except FileExistsError:  # a group of that name we did not make: skip the name
                continue
            except OSError:
                return None
            self.job_dirs.append(path)
            return path

    def retire_job_dir(self, path: Path) -> None:
        """Never hand ``path`` out again, and remove it once it is empty: its name is never
        reused, so a descriptor to it still open somewhere reaches only a removed group. (Kept
        until the sandbox's end, a sandbox killing the processes prepared for it could pile up
        groups without bound: about six a second were measured.)"""
        self.job_count = max(self.job_count, len(self.job_dirs))
        if path in self.job_dirs:
            self.job_dirs.remove(path)
        self.retired.add(path)
        self._remove_retired()

    def _remove_retired(self) -> None:
        for path in list(self.retired):
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:  # a process is (still) in it: tried again with the next group handed out
                if exc.errno != errno.EBUSY:
                    log.warning("could not remove the retired job group %s: %s", path, exc)
                continue
            self.retired.discard(path)

    def claim_job_dir(self) -> Optional[Path]:
        """``job_dir``, kept from everyone else until ``release_job_dir``: for a process that
        joins it later (the spawner's next process, written in after its hello; orchard-enter,
        which joins after its exec), so the group still reads empty meanwhile."""
        path = self.job_dir()
        if path is not None:
            self.reserved.add(path)
        return path

    def release_job_dir(self, path: Optional[Path]) -> None:
        if path is not None:
            self.reserved.discard(path)

    def job_procs_files(self, job_dir: Optional[Path]) -> list[str]:
        """Where a command's helper writes its pid: the job's group replaces its parent."""
        if job_dir is None:
            return self.procs_files
        return [str(job_dir / "cgroup.procs") if c == self.job_controller else str(d / "cgroup.procs")
                for c, d in self.dirs.items()]

    def pids(self, root: Optional[Path] = None) -> set[int]:
        found: set[int] = set()
        for top in [root] if root is not None else list(self.dirs.values()):
            for d in _walk_bottom_up(top):
                try:
                    found.update(int(line) for line in (d / "cgroup.procs").read_text().split())
                except OSError:
                    pass
        return found

    def kill_all(self, root: Optional[Path] = None) -> None:
        """SIGKILL every process in the sandbox's groups (or under ``root`` only)."""
        for _ in range(3):  # a fork racing the kill is caught on the next pass
            pids = self.pids(root)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove(self) -> bool:
        """Remove the directories (job groups first); False while a process still lives in them."""
        ok = True
        for top in self.dirs.values():
            for d in _walk_bottom_up(top):
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    ok = False
        return ok

    def new_oom_kills(self) -> int:
        """OOM kills since the last call (read only when a command died of a signal)."""
        total = self.oom_kills()
        new, self.oom_kills_seen = total - self.oom_kills_seen, total
        return new

    def oom_kills(self) -> int:
        """How many processes the OOM killer ended in this sandbox so far."""
        d = self.dirs.get("memory")
        if d is None:
            return 0
        for name in ("memory.oom_control", "memory.events"):  # v1, v2
            try:
                for line in (d / name).read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
            except (OSError, ValueError):
                continue
        return 0


def orchard_dirs_below(roots: list[Path]) -> list[Path]:
    """Every ``orchard`` directory below the hierarchy roots but at their top: where agents
    running below their own cgroup (Slurm pilots) keep their trees. Sandbox groups are not
    descended into (nothing in a sandbox can make cgroups)."""
    found = []
    for root in roots:
        for directory, children, _ in os.walk(root):
            if os.path.basename(directory) == "orchard":
                if os.path.dirname(directory) != str(root):
                    found.append(Path(directory))
                children.clear()  # agents' trees: no pilot's below them
    return found


def own_v1_paths(proc_cgroup: str) -> dict[str, str]:
    """This process's cgroup in each v1 controller, from /proc/self/cgroup."""
    paths = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            if controller:
                paths[controller] = path
    return paths


class CgroupManager:
    """Creates sandbox cgroups under ``<hierarchy>/orchard/<agent>/<sandbox>``; with
    ``below_own`` (cgroup v1), under the agent's own cgroup instead, so whatever bounds the
    agent (a Slurm job's cgroup) bounds its sandboxes."""

    def __init__(self, agent_name: str, below_own: bool = False, total_pids: Optional[int] = None) -> None:
        self.agent_name = agent_name
        self.below_own = below_own
        self.total_pids = total_pids  # pids.max of the agent's own group: all its sandboxes together
        self._total_set = False
        self.mode, self.bases = self._detect()
        # Trees below the agent's own cgroup go with it (a Slurm job's); the shared ones (all of
        # them, or below_own, those of controllers the job does not constrain: a pilot's pids
        # tree where Slurm sets no pids cgroup) are claimed, where this agent can make any (a
        # container's read-only cgroupfs: none, and no claim file), so a later agent removes
        # them should this one be killed.
        # A tree below the agent's own cgroup (a Slurm pilot's) is claimed too: a pilot killed
        # outright leaves it there, and with it Slurm cannot remove the job's cgroup; a later
        # agent on the node removes the trees whose claims are free (remove_dead_agents_trees).
        self.roots = {V1_ROOT, *(V1_ROOT / controller for controller in self.bases)}  # v2's, and each v1 hierarchy's
        self.shared = [base for base in self.bases.values() if base.parent.parent in self.roots]
        self.ownership = CgroupOwnership(agent_name)
        if (self.shared and self._writable()) or (self.bases and self.below_own):
            self.ownership.hold()

    def _writable(self) -> bool:
        return all(os.access(base.parent.parent, os.W_OK) for base in self.shared)

    @property
    def available(self) -> bool:
        return bool(self.bases)

    def _detect(self) -> tuple[str, dict[str, Path]]:
        if os.geteuid() != 0:
            return "none", {}
        v1 = {c: V1_ROOT / c for c in ("memory", "pids", "cpu") if (V1_ROOT / c / "cgroup.procs").exists()}
        if v1:
            own = own_v1_paths(Path("/proc/self/cgroup").read_text()) if self.below_own else {}
            return "v1", {c: p / own.get(c, "/").lstrip("/") / "orchard" / self.agent_name for c, p in v1.items()}
        if (V1_ROOT / "cgroup.controllers").exists():
            return "v2", {"unified": V1_ROOT / "orchard" / self.agent_name}
        return "none", {}

    def create(self, sandbox_id: str, memory: Optional[int], pids: Optional[int], cpus: Optional[float],
               socket_memory: Optional[int] = None) -> SandboxCgroup:
        """``socket_memory`` (cgroup v1): the TCP buffers its sockets may hold, which v1 does
        not count against ``memory`` (cgroup v2 does, so there it needs no limit of its own)."""
        group = SandboxCgroup()
        for controller, base in self.bases.items():
            path = base / sandbox_id
            if self.mode == "v2":
                self._enable_v2_controllers(path)
            path.mkdir(parents=True, exist_ok=True)
            if controller in ("pids", "unified") and self.total_pids and not self._total_set:
                (base / "pids.max").write_text(str(self.total_pids))  # the base exists now (mkdir parents)
                self._total_set = True
            group.dirs["memory" if controller == "unified" else controller] = path
            self._apply(controller, path, memory, pids, cpus)
            if controller == "memory" and socket_memory and (path / "memory.kmem.tcp.limit_in_bytes").exists():
                (path / "memory.kmem.tcp.limit_in_bytes").write_text(str(socket_memory))
        if self.mode == "v1" and "pids" in group.dirs:
            group.job_controller = "pids"
        return group

    def _enable_v2_controllers(self, path: Path) -> None:
        for parent in [V1_ROOT, *reversed(path.parents[: len(path.relative_to(V1_ROOT).parts) - 1])]:
            parent.mkdir(exist_ok=True)
            try:
                (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            except OSError:
                pass

    def _apply(self, controller: str, path: Path, memory: Optional[int], pids: Optional[int], cpus: Optional[float]) -> None:
        writes: list[tuple[str, str]] = []
        if controller == "memory" and memory:
            writes += [("memory.limit_in_bytes", str(memory))]
            if (path / "memory.memsw.limit_in_bytes").exists():
                writes += [("memory.memsw.limit_in_bytes", str(memory))]
        elif controller == "pids" and pids:
            writes += [("pids.max", str(pids))]
        elif controller == "cpu" and cpus:
            writes += [("cpu.cfs_period_us", str(CFS_PERIOD_US)), ("cpu.cfs_quota_us", str(int(cpus * CFS_PERIOD_US)))]
        elif controller == "unified":
            if memory:
                writes += [("memory.max", str(memory)), ("memory.swap.max", "0")]
            if pids:
                writes += [("pids.max", str(pids))]
            if cpus:
                writes += [("cpu.max", f"{int(cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}")]
        for name, value in writes:
            try:
                (path / name).write_text(value)
            except OSError:
                if not name.startswith(("memory.memsw", "memory.swap")):
                    raise

    def remove_bases(self) -> None:
        """Remove this agent's (empty) cgroup directories when it stops. Below its own cgroup
        the ``orchard`` directory above them goes too: it is this agent's alone, and a Slurm
        job whose task cgroup kept it could not remove its own tree at the job's end. A shared
        one stays: another agent may be making its tree there."""
        for base in self.bases.values():
            for directory in (base,) if base in self.shared else (base, base.parent):
                try:
                    directory.rmdir()
                except OSError:
                    break
        self.ownership.release(forget=not any(base.exists() for base in self.shared))

    def remove_dead_agents_trees(self, patience: float = 1.0) -> list[str]:
        """Remove the trees of agents on this host that died without cleaning up (see
        cgroup_owners.py). Only trees with no process left in them, and nothing is killed: an
        agent that could not take its claim (its predecessor on the state directory took more
        than a few seconds to exit) looks dead from here while it lives."""
        parents = {base.parent for base in self.shared}
        if self.below_own:  # dead pilots' trees below their jobs' cgroups, wherever those are
            hierarchies = [V1_ROOT] if self.mode == "v2" else sorted(self.roots - {V1_ROOT})
            parents |= set(orchard_dirs_below([root for root in hierarchies if root.is_dir()]))
        if not parents:
            return []

        def remove(tree: Path) -> bool:
            group = SandboxCgroup({"leftover": tree})
            deadline = time.monotonic() + patience
            while group.pids():  # a dead agent's holders die with it, within moments
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
            gone = group.remove() or not tree.exists()
            if gone and tree.parent.parent not in self.roots:  # a pilot's own "orchard" directory: its alone
                try:
                    tree.parent.rmdir()
                except OSError:
                    pass  # another tree of it is still there
            return gone

        return self.ownership.remove_orphans(sorted(parents), remove)

    def leftovers(self) -> list[Path]:
        """Sandbox cgroups that still exist (for leak checks)."""
        return [p for base in self.bases.values() if base.exists() for p in base.iterdir() if p.is_dir()]
