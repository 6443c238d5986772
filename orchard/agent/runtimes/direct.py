"""``direct``: commands run in the agent's own container, with no isolation of their own.

For a Kubernetes pod or a one-job-per-sandbox Slurm job, where the container *is* the
sandbox. Never chosen implicitly on a shared host: it must be asked for by name.
"""

from __future__ import annotations

import os

from orchard.agent.environment import image_environment
from orchard.agent.runtimes.api import IsolationRuntime
from orchard.agent.sandbox import Placement, SandboxState
from orchard.errors import InvalidRequest, QuotaExceeded
from orchard.quantities import parse_bytes, parse_cpu


class DirectRuntime(IsolationRuntime):
    name = "direct"
    runs_in_place = True

    async def start(self, sandbox: SandboxState) -> None:
        if sandbox.spec.image not in ("host", "direct"):
            raise InvalidRequest("the direct runtime runs in the agent's own image; ask for image 'host'")
        workdir = os.environ.get("ORCHARD_WORKDIR", "")  # the image's WORKDIR, from whoever started us
        if not os.path.isdir(workdir):
            workdir = "/workspace" if os.path.isdir("/workspace") else "/"
        env = {**image_environment(), "HOME": os.environ.get("HOME", "/root")}
        sandbox.placement = Placement(root="/", shell="bash" if os.path.exists("/bin/bash") else "sh",
                                      default_cwd=workdir, env=env)
        spec = sandbox.spec
        if spec.memory or spec.pids or spec.cpu:
            if not self.context.cgroups.available:
                raise QuotaExceeded("resource limits were asked for, but no cgroup hierarchy is writable here")
            sandbox.cgroup = self.context.cgroups.create(
                sandbox.sandbox_id, parse_bytes(spec.memory) if spec.memory else None, spec.pids,
                parse_cpu(spec.cpu) if spec.cpu else None)

    async def stop(self, sandbox: SandboxState) -> None:
        if sandbox.cgroup is not None:
            sandbox.cgroup.kill_all()
            sandbox.cgroup.remove()
