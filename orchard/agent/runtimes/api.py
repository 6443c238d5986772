"""The isolation-runtime interface: how the agent starts, enters and stops sandboxes.

Built-in runtimes are ``direct`` (commands run in the agent's own container) and
``bwrap`` (one set of namespaces per sandbox, held by a tiny holder process).
Plugins add more through ``orchard_register_runtimes``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Optional

from orchard.errors import RuntimeUnavailable, Unsupported

if TYPE_CHECKING:
    from orchard.agent.cgroups import CgroupManager
    from orchard.agent.egress import Egress
    from orchard.agent.images import ImageStore
    from orchard.agent.reaper import ChildReaper
    from orchard.agent.sandbox import SandboxState
    from orchard.agent.settings import AgentSettings
    from orchard.agent.spawner import SpawnerClient

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # inside a sandbox whose image sets none


@dataclass
class RuntimeContext:
    """What every runtime gets from the agent."""

    settings: "AgentSettings"
    helper: Path  # the static orchard-enter binary
    cgroups: "CgroupManager"
    images: "ImageStore"
    reaper: "ChildReaper"
    egress: "Egress"  # how sandboxes with network get out of their own network namespace


def open_files_args(context: RuntimeContext) -> list[str]:
    """``--nofile SOFT:HARD`` for orchard-enter: the sandbox's own open-files limit, never
    the agent's (raised to the host's hard limit, which every process it started inherited)."""
    hard = context.settings.sandbox_open_files
    return ["--nofile", f"{min(1024, hard)}:{hard}"]


class IsolationRuntime(ABC):
    name: ClassVar[str]
    runs_in_place: ClassVar[bool] = False  # the agent's own container is the sandbox (``direct``)
    snapshots: ClassVar[bool] = False  # can freeze a sandbox's writable layer for forks (see freeze)

    def __init__(self, context: RuntimeContext) -> None:
        self.context = context

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """None if this runtime can run here, else a reason a person can act on."""
        return None

    @abstractmethod
    async def start(self, sandbox: "SandboxState") -> None:
        """Create the sandbox and set ``sandbox.placement``; raise a typed error on failure."""

    @abstractmethod
    async def stop(self, sandbox: "SandboxState") -> None:
        """Kill everything in the sandbox and remove what it left on the host."""

    async def freeze(self, sandbox: "SandboxState", directory: Path) -> Path:
        """Stop the sandbox (as ``stop`` does) but move its state directory to ``directory``
        with the writable layer kept; return the layer's upper directory. Runtimes whose
        sandboxes have an overlay layer (``snapshots = True``) implement this."""
        raise Unsupported(f"runtime {self.name!r} cannot snapshot sandboxes")

    def command(self, sandbox: "SandboxState", argv: list[str], cwd: str, job_cgroup: Optional[Path] = None) -> list[str]:
        """The argv the agent spawns to run ``argv`` in ``cwd`` inside the sandbox."""
        placement = sandbox.placement
        assert placement is not None
        full = [str(self.context.helper), "--seccomp", "--oom-first", *open_files_args(self.context)]
        if sandbox.cgroup is not None:
            for procs in sandbox.cgroup.job_procs_files(job_cgroup):
                full += ["--cgroup", procs]
        if placement.target_pid is not None:
            full += ["--target", str(placement.target_pid)]
        full += ["--cwd", cwd]
        if placement.uid is not None:
            full += ["--uid", str(placement.uid), "--gid", str(placement.gid)]
        return full + ["--", *argv]

    def spawner(self, sandbox: "SandboxState") -> Optional["SpawnerClient"]:
        """The sandbox's spawner (its holder forking commands, ``spawner.py``) while it is
        usable; None: commands go through ``command``."""
        return None

    def file_command(self, sandbox: "SandboxState", operation: list[str]) -> list[str]:
        """The argv that does a file operation (``enter_files.c``) from inside the sandbox,
        where a command would run. Runtimes whose commands do not start with the helper
        entering the sandbox must override this or refuse."""
        placement = sandbox.placement
        assert placement is not None
        if placement.target_pid is None and not self.runs_in_place:
            raise RuntimeUnavailable(f"runtime {self.name!r} cannot do file calls inside this sandbox")
        full = self.command(sandbox, operation, "/")
        return [full[0], "--file", *full[1:]]

