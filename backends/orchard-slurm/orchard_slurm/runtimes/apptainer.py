"""``apptainer``: each sandbox is an Apptainer (or SingularityCE) instance.

``instance start`` per sandbox through spython, with ``--containall`` (its own PID, IPC
and mount namespaces, a clean environment), a writable overlay directory on the node's
disk, the site's binds, ``--nv`` when the pilot holds GPUs, its own hostname, and a
network namespace with no interfaces when the sandbox blocks its network (``--net
--network none``, which Apptainer allows unprivileged users). Where the instance lives in
a user namespace below the agent's (Apptainer's default for unprivileged users) commands
join it with ``orchard-enter --target``, which costs milliseconds; a setuid installation
runs them with ``singularity exec instance://NAME`` instead. Images: ``docker://``,
``oras://`` and ``library://`` references are pulled once into the SIF cache; local SIF
files and sandbox directories are used as they are.

Apptainer cannot be installed on our CI machines: the command lines are tested against
golden files (backends/orchard-slurm/tests/golden/apptainer), nothing here ran for real.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

from orchard.agent.inroot import exists_in_root
from orchard.agent.reaper import run_tool
from orchard.agent.runtimes.api import DEFAULT_PATH, IsolationRuntime
from orchard.agent.runtimes.mounts import remove_tree
from orchard.agent.runtimes.holder import launcher_prefix
from orchard.agent.sandbox import Placement, SandboxState
from orchard.errors import ImageRejected, InvalidRequest, RuntimeUnavailable
from orchard.quantities import optional_bytes, parse_cpu
from orchard_slurm.runtimes.processes import process_exit, user_ns_below_ours

PULLED = ("docker://", "oras://", "library://", "shub://")


def instance_name(sandbox_id: str) -> str:
    """Apptainer instance names allow [a-zA-Z0-9._-]."""
    return "orchard-" + re.sub(r"[^a-zA-Z0-9._-]", "-", sandbox_id)


def pilot_has_gpus(environ: dict[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_GPUS") or environ.get("CUDA_VISIBLE_DEVICES"))


def container_options(sandbox_id: str, block_network: bool, binds: list[str], gpus: bool,
                      layer: list[str]) -> list[str]:
    """The options of every Orchard Apptainer container, an instance or a per-job container
    (see the module docstring for why); ``layer`` says how its root is writable."""
    options = ["--containall", "--no-home", "--cleanenv", "--hostname", sandbox_id[:63], *layer]
    for bind in binds:
        options += ["--bind", bind]
    if gpus:
        options.append("--nv")
    if block_network:
        options += ["--net", "--network", "none"]
    return options


def instance_options(sandbox_id: str, block_network: bool, overlay: Path, binds: list[str], gpus: bool) -> list[str]:
    """The ``instance start`` options of one sandbox on a pilot: its own overlay directory."""
    return container_options(sandbox_id, block_network, binds, gpus, ["--overlay", str(overlay)])


def sif_name(reference: str) -> str:
    readable = re.sub(r"[^a-zA-Z0-9._-]", "_", reference.split("://", 1)[1])[:80]
    return f"{readable}-{hashlib.sha256(reference.encode()).hexdigest()[:12]}.sif"


class ApptainerRuntime(IsolationRuntime):
    name = "apptainer"

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if shutil.which("singularity") is None:
            return "neither apptainer nor singularity is installed (spython runs 'singularity', which apptainer provides)"
        return None

    @property
    def cache_dir(self) -> Path:
        return Path(os.environ.get("ORCHARD_APPTAINER_CACHE", str(self.context.settings.state_dir / "sif-cache")))

    def _owner(self) -> Optional[tuple[int, int]]:
        return self.context.images.owner  # the agent's first host ids (root agents), else None

    async def _call(self, sandbox: Optional[SandboxState], **request: object) -> dict:
        """One spython call in a child process (in the sandbox's cgroup; Apptainer as the
        unprivileged owner under a root agent)."""
        prefix = launcher_prefix(self.context, sandbox, None)
        owner = self._owner()
        request = {**request, "as_ids": list(owner) if owner else None}
        argv = [*prefix, sys.executable, "-m", "orchard_slurm.runtimes.spython_calls", json.dumps(request)]
        env = {"PATH": os.environ.get("PATH", DEFAULT_PATH), "HOME": os.environ.get("HOME", "/"),
               **{k: v for k, v in os.environ.items() if k.startswith(("APPTAINER", "SINGULARITY"))}}
        code, out, err = await run_tool(self.context.reaper, argv, env)
        if code != 0:
            raise RuntimeUnavailable(f"apptainer {request['op']} failed: {err.strip()[-2000:] or f'exit {code}'}")
        return json.loads(out.strip().splitlines()[-1])

    async def _image(self, reference: str) -> str:
        if reference == "host":
            raise InvalidRequest("the apptainer runtime runs images: ask for a docker:// reference, a SIF file "
                                 "or a sandbox directory, not 'host'")
        if reference.startswith(PULLED) and self.context.settings.signature_policy:
            raise ImageRejected(f"image {reference!r}: signature_policy is set, and Apptainer pulls images itself, "
                                "without it; give a SIF file (checked with `apptainer verify`) or a directory")
        if not reference.startswith(PULLED):
            if not Path(reference).exists():
                raise ImageRejected(f"image {reference!r}: no such SIF file or directory")
            return reference
        cached = self.cache_dir / sif_name(reference)
        if not cached.exists():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            if self._owner():
                os.chown(self.cache_dir, *self._owner())
            result = await self._call(None, op="pull", reference=reference, folder=str(self.cache_dir),
                                      name=cached.name)
            return result["path"]
        return str(cached)

    async def start(self, sandbox: SandboxState) -> None:
        spec = sandbox.spec
        image = await self._image(spec.image)
        overlay = sandbox.state_dir / "overlay"
        overlay.mkdir(parents=True, mode=0o700)
        owner = self._owner()
        if owner:
            for path in (sandbox.state_dir, overlay):
                os.chown(path, *owner)
        name = instance_name(sandbox.sandbox_id)
        placement = Placement(root="", env={"PATH": DEFAULT_PATH, "HOME": "/root", **spec.env}, default_cwd="/")
        sandbox.placement = placement
        if spec.disk:  # limits it cannot enforce are refused, never silently dropped
            raise InvalidRequest("disk: the apptainer runtime cannot enforce a disk quota on its overlay directory; "
                                 "leave disk unset or use the bwrap or charliecloud runtime")
        if (spec.memory or spec.pids or spec.cpu) and not self.context.cgroups.available:
            raise InvalidRequest("memory/pids/cpu: no cgroup hierarchy is writable for this agent, so the apptainer "
                                 "runtime cannot enforce them; leave them unset or run the pilot where it can")
        if self.context.cgroups.available and (spec.memory or spec.pids or spec.cpu):
            sandbox.cgroup = self.context.cgroups.create(sandbox.sandbox_id, optional_bytes(spec.memory), spec.pids,
                                                         parse_cpu(spec.cpu) if spec.cpu else None)
        options = instance_options(sandbox.sandbox_id, spec.block_network, overlay,
                                   [b for b in os.environ.get("ORCHARD_APPTAINER_BINDS", "").split(",") if b],
                                   pilot_has_gpus(dict(os.environ)))
        pid = (await self._call(sandbox, op="start", image=image, name=name, options=options))["pid"]
        placement.holder_pid = pid
        placement.root = f"/proc/{pid}/root"
        if os.geteuid() == 0 or user_ns_below_ours(pid):
            placement.target_pid = pid
            placement.uid, placement.gid = owner or (os.getuid(), os.getgid())
        sandbox.holder_exit = process_exit(pid)
        placement.shell = "bash" if exists_in_root(placement.root, "/bin/bash") else "sh"  # never a host path

    def command(self, sandbox: SandboxState, argv: list[str], cwd: str, job_cgroup: Optional[Path] = None) -> list[str]:
        placement = sandbox.placement
        assert placement is not None
        if placement.target_pid is not None:
            return super().command(sandbox, argv, cwd, job_cgroup)
        return super().command(sandbox, ["singularity", "--quiet", "exec", "--pwd", cwd,
                                         f"instance://{instance_name(sandbox.sandbox_id)}", *argv], "/", job_cgroup)

    async def stop(self, sandbox: SandboxState) -> None:
        placement = sandbox.placement
        if placement is not None and placement.holder_pid:
            try:
                await self._call(sandbox, op="stop", name=instance_name(sandbox.sandbox_id))
            except RuntimeUnavailable:
                pass  # already gone; the kill below makes sure
            try:
                os.kill(placement.holder_pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        if sandbox.cgroup is not None:
            sandbox.cgroup.kill_all()
            sandbox.cgroup.remove()
        remove_tree(sandbox.state_dir)
