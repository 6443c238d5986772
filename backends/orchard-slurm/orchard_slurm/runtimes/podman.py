"""``podman``: each sandbox is a Podman container (runc) kept by ``orchard-enter --hold``.

``podman run -d`` with the holder bound in as the entrypoint: the container's own PID, IPC,
UTS and mount namespaces, a network namespace of its own (``--network none``; a sandbox
with network gets its way out from the agent's egress, as bubblewrap sandboxes do), all
capabilities dropped, and under a root
agent a user namespace whose root is the unprivileged host uid (``--uidmap``), so images
that expect root work without root on the host. Commands join the container's PID with
``orchard-enter --target`` and its cgroup (where Podman put the limits), so an exec costs
milliseconds, not a ``podman exec``. Directory images are imported into Podman's storage
once; ``docker://`` references are pulled. Podman's configuration and storage live in the
agent's state directory (runc, cgroupfs, file events: see shared/notes on Podman 4.3).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

from orchard.agent.cgroups import own_v1_paths
from orchard.agent.inroot import exists_in_root
from orchard.agent.reaper import run_tool
from orchard.agent.runtimes.api import DEFAULT_PATH, IsolationRuntime
from orchard.agent.runtimes.holder import limit_ptys
from orchard.agent.runtimes.mounts import MASKED_PROC_DIRS, MASKED_PROC_FILES, remove_tree
from orchard.agent.sandbox import Placement, SandboxState
from orchard.errors import ImageRejected, InvalidRequest, RuntimeUnavailable
from orchard.quantities import parse_cpu, parse_memory
from orchard_slurm.config import PODMAN_ID_SPAN
from orchard_slurm.runtimes.processes import process_exit

HOLD_PATH = "/.orchard-hold"
RM_ATTEMPTS = 3  # podman rm -f of a container that stopped by itself meanwhile fails once ("state improper")
LIFELINE_FD = 3  # the first descriptor ``--preserve-fds 1`` hands to the container
HOLD_ARGS = ["--hold", "--lifeline", str(LIFELINE_FD)]
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def container_name(sandbox_id: str) -> str:
    return "orchard-" + re.sub(r"[^a-zA-Z0-9_.-]", "-", sandbox_id)


def remove_empty_cgroup_trees(parent: str) -> None:
    """Remove ``parent`` (a cgroup path Podman made in every v1 hierarchy for its containers)
    wherever it is empty, deepest first: Podman removes a container's own group, not the
    ones above it, and 48 empty directories under a cancelled pilot's job kept Slurm from
    removing the job's cgroup. A group still holding a process stays (rmdir refuses it)."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / parent.lstrip("/")
        if not top.is_dir() or top.is_symlink():
            continue
        for directory, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(directory)
            except OSError:
                continue


def masked_proc_paths() -> list[str]:
    """The host-global /proc entries bwrap sandboxes mask, for Podman to mask as well (its own
    default list leaves /proc/kallsyms and others readable)."""
    return [f"/proc/{name}" for name in (*MASKED_PROC_FILES, *MASKED_PROC_DIRS) if os.path.exists(f"/proc/{name}")]


def run_options(sandbox_id: str, helper: Path, idmap: Optional[tuple[int, int]],
                memory: Optional[str], pids: Optional[int], cpu: Optional[str],
                cgroup_parent: Optional[str] = None, resolv_conf: Optional[Path] = None) -> list[str]:
    """``podman run`` options of one sandbox (see the module docstring for why). Its network
    is always a namespace of its own (``none``); an open sandbox gets its way out from the
    agent's egress, and ``resolv_conf`` (that egress's name servers) as /etc/resolv.conf."""
    options = ["-d", "--name", container_name(sandbox_id), "--hostname", sandbox_id[:63],
               "--network", "none", "--cap-drop", "all", "--cgroupns", "private",
               "--security-opt", "no-new-privileges", "--security-opt", f"mask={':'.join(masked_proc_paths())}",
               "-v", f"{helper}:{HOLD_PATH}:ro", "--entrypoint", HOLD_PATH, "--preserve-fds", "1"]
    if cgroup_parent:
        options += ["--cgroup-parent", cgroup_parent]
    if resolv_conf is not None:
        options += ["-v", f"{resolv_conf}:/etc/resolv.conf:ro"]
    if idmap:
        options += ["--uidmap", f"0:{idmap[0]}:{PODMAN_ID_SPAN}", "--gidmap", f"0:{idmap[1]}:{PODMAN_ID_SPAN}"]
    if memory:
        options += ["--memory", str(parse_memory(memory))]  # bytes: "512M" is 10^6 bytes, Podman's "512m" MiB
    if pids:
        options += ["--pids-limit", str(pids)]
    if cpu:
        options += ["--cpus", f"{parse_cpu(cpu):g}"]
    return options


def cgroup_procs_files(pid: int) -> list[str]:
    """The cgroup.procs of ``pid``'s cgroup in each hierarchy (v1 controllers or v2), read
    from /proc: where Podman put the container, so commands that join get its limits."""
    found = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers.startswith("name="):
            continue
        mount = Path("/sys/fs/cgroup") / controllers if controllers else Path("/sys/fs/cgroup")
        if controllers and not mount.is_dir():
            mount = Path("/sys/fs/cgroup") / controllers.split(",")[0]
        procs = mount / path.lstrip("/") / "cgroup.procs"
        if path != "/" and procs.exists() and (controllers or not found):
            found.append(str(procs))
    return found[:8]  # orchard-enter joins at most 8


async def holder_running(pid: int, name: str, timeout: float = 5.0) -> None:
    """Wait until the container's process is the holder: the PID file can name it while
    runc's init is still setting it up (not yet enterable)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(HOLD_PATH.encode() + b"\0"):
                return
        except OSError:
            raise RuntimeUnavailable(f"container {name} exited as it started") from None
        if time.monotonic() > deadline:
            raise RuntimeUnavailable(f"container {name} did not start its holder within {timeout:.0f} s")
        await asyncio.sleep(0.005)


class PodmanRuntime(IsolationRuntime):
    name = "podman"

    def __init__(self, context) -> None:
        super().__init__(context)
        self._imports: dict[str, asyncio.Lock] = {}
        self._imported: set[str] = set()
        self._cgroups: dict[str, list[str]] = {}
        self._lifelines: dict[str, int] = {}  # sandbox id -> the write end of its lifeline

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        missing = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
        return f"not installed: {', '.join(missing)} (apt-get install podman runc)" if missing else None

    @property
    def home(self) -> Path:
        return self.context.settings.state_dir / "podman"

    @functools.cached_property
    def _env(self) -> dict[str, str]:
        """One configuration and one storage for every podman call (they must agree),
        written once per agent."""
        conf, storage = self.home / "containers.conf", self.home / "storage.conf"
        self.home.mkdir(parents=True, exist_ok=True)
        conf.write_text(CONTAINERS_CONF)
        storage.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{self.home / "graph"}"\n'
                           f'runroot = "{self.home / "run"}"\n')
        return {"PATH": os.environ.get("PATH", DEFAULT_PATH), "HOME": os.environ.get("HOME", "/"),
                "CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage),
                **{k: v for k, v in os.environ.items() if k == "XDG_RUNTIME_DIR"}}

    @functools.cached_property
    def _cgroup_parent(self) -> Optional[str]:
        """Below the agent's own memory cgroup when asked (``cgroups_below_own``: a pilot, whose
        job's memory limit must bound its containers too), else Podman's ``libpod_parent``.
        Read once: the agent never moves."""
        if not self.context.settings.cgroups_below_own:
            return None
        own = own_v1_paths(Path("/proc/self/cgroup").read_text()).get("memory", "/")
        return None if own == "/" else f"{own.rstrip('/')}/orchard-podman"

    def _lifeline(self, sandbox_id: str) -> int:
        """The read end of the sandbox's lifeline: its holder exits, ending the container, when
        the write end this agent keeps (close-on-exec, so nothing else holds it) closes, as it
        does when the agent dies. conmon, not us, supervises the container: without this it
        outlived a killed agent, and its Slurm job."""
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        self._lifelines[sandbox_id] = write_end
        return read_end

    async def _podman(self, *args: str, pass_fds: Optional[dict[int, int]] = None) -> str:
        # conmon writes files (an "oom" marker) relative to where it starts: in our home, not the job's cwd
        code, out, err = await run_tool(self.context.reaper, ["env", "-C", str(self.home), "podman", *args],
                                        self._env, pass_fds)
        if code != 0:
            raise RuntimeUnavailable(f"podman {args[0]} failed: {err.strip()[-1500:] or f'exit {code}'}")
        return out

    async def _image(self, reference: str) -> str:
        if reference == "host":
            raise InvalidRequest("the podman runtime runs images: ask for a docker:// reference or an image "
                                 "directory, not 'host'")
        if reference.startswith("docker://"):
            await self._podman("pull", "--quiet", reference)
            return reference.removeprefix("docker://")
        directory = Path(reference)
        if not directory.is_dir():
            raise ImageRejected(f"image {reference!r}: no such directory (or use a docker:// reference)")
        digest = hashlib.sha256(f"{directory.resolve()}:{directory.stat().st_mtime_ns}".encode()).hexdigest()[:16]
        name = f"localhost/orchard-dir-{digest}"
        if name in self._imported:
            return name
        async with self._imports.setdefault(name, asyncio.Lock()):
            code, _, _ = await run_tool(self.context.reaper, ["podman", "image", "exists", name], self._env)
            if code != 0 and name not in self._imported:
                archive = self.home / f"{digest}.tar"
                code, _, err = await run_tool(self.context.reaper, ["tar", "-C", str(directory), "-cf", str(archive),
                                                                    "."], {"PATH": DEFAULT_PATH})
                try:
                    if code != 0:
                        raise ImageRejected(f"cannot read image directory {reference}: {err.strip()[-500:]}")
                    await self._podman("import", "--quiet", str(archive), name)
                finally:
                    archive.unlink(missing_ok=True)
            self._imported.add(name)
        return name

    async def start(self, sandbox: SandboxState) -> None:
        settings, spec = self.context.settings, sandbox.spec
        if spec.disk:  # refused, never silently dropped
            raise InvalidRequest("disk: the podman runtime cannot enforce a disk quota here (its overlay storage "
                                 "has none); leave disk unset or use the bwrap or charliecloud runtime")
        image = await self._image(spec.image)
        idmap = self.context.images.owner  # the agent's first host ids (root agents), else None
        placement = Placement(root="", uid=0, gid=0,
                              env={"PATH": DEFAULT_PATH, "HOME": "/root", **spec.env}, default_cwd="/")
        sandbox.placement = placement
        name = container_name(sandbox.sandbox_id)
        sandbox.state_dir.mkdir(parents=True, exist_ok=True)
        pidfile = sandbox.state_dir / "container.pid"
        lifeline = self._lifeline(sandbox.sandbox_id)
        egress = self.context.egress
        if egress.shares_host_network and not spec.block_network:
            raise InvalidRequest("block_network: false with network_egress 'host' is not offered by the podman "
                                 "runtime (its sandboxes always have a network namespace of their own)")
        resolv_conf = None
        if not spec.block_network and egress.resolv_conf() is not None:
            resolv_conf = settings.share_dir / "resolv.conf"
        try:
            await self._podman("run", "--pidfile", str(pidfile), *run_options(
                sandbox.sandbox_id, self.context.helper, idmap,
                spec.memory or settings.default_memory, spec.pids or settings.default_pids, spec.cpu,
                self._cgroup_parent, resolv_conf), image, *HOLD_ARGS, pass_fds={lifeline: LIFELINE_FD})
        except BaseException:
            write_end = self._lifelines.pop(sandbox.sandbox_id, None)
            if write_end is not None:
                os.close(write_end)
            raise
        finally:
            os.close(lifeline)  # the container holds it now
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            raise RuntimeUnavailable(f"container {name} started but left no PID") from None
        await holder_running(pid, name)
        placement.holder_pid = placement.target_pid = pid
        placement.root = f"/proc/{pid}/root"
        placement.shell = "bash" if exists_in_root(placement.root, "/bin/bash") else "sh"  # never a host path
        if exists_in_root(placement.root, "/workspace", directory=True):
            placement.default_cwd = "/workspace"
        self._cgroups[sandbox.sandbox_id] = cgroup_procs_files(pid)
        sandbox.holder_exit = process_exit(pid)
        await limit_ptys(self.context, pid)  # Podman's devpts has no max= either
        if not spec.block_network:
            await egress.attach(sandbox.sandbox_id, pid)

    def command(self, sandbox: SandboxState, argv: list[str], cwd: str, job_cgroup: Optional[Path] = None) -> list[str]:
        full = super().command(sandbox, argv, cwd, job_cgroup)
        joins = [flag for procs in self._cgroups.get(sandbox.sandbox_id, []) for flag in ("--cgroup", procs)]
        return [full[0], *joins, *full[1:]]  # in the container's cgroup: its limits apply to commands too

    async def stop(self, sandbox: SandboxState) -> None:
        """Remove the container, then close its lifeline. Closed first, the lifeline made the
        container stop on its own while ``podman rm -f`` stopped it, and podman failed the
        remove ("container state improper: stopped"; once in CI, on a loaded machine). A
        container that stops by itself meanwhile anyway (its holder killed) gets another try."""
        self._cgroups.pop(sandbox.sandbox_id, None)
        try:
            if sandbox.placement is not None:
                await self._remove_container(container_name(sandbox.sandbox_id))
        finally:
            lifeline = self._lifelines.pop(sandbox.sandbox_id, None)
            if lifeline is not None:
                os.close(lifeline)
        await self.context.egress.detach(sandbox.sandbox_id)
        remove_tree(sandbox.state_dir)
        if self._cgroup_parent is not None and not self._lifelines:
            remove_empty_cgroup_trees(self._cgroup_parent)

    async def _remove_container(self, name: str) -> None:
        for attempt in range(RM_ATTEMPTS):
            code, _, err = await run_tool(self.context.reaper, ["podman", "rm", "-f", "-t", "0", name], self._env)
            if code == 0 or "no such container" in err.lower():
                return
            if attempt + 1 < RM_ATTEMPTS:
                await asyncio.sleep(0.2 * (attempt + 1))
        raise RuntimeUnavailable(f"podman rm failed: {err.strip()[-500:]}")
