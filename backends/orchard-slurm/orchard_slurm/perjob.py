"""What runs inside a per-job Slurm job: one sandbox, which is one container with the
exec agent inside it (from the agent bundle, bound read-only at /opt/orchard).

For sites that want Slurm to account every sandbox. The agent serves on a Unix socket
that this job creates outside the container and hands in as an inherited descriptor, so
the container can have a network namespace with no interfaces at all when the sandbox
blocks its network, and no socket path exists that the sandbox could replace; this job
relays TCP on the compute node to that socket (checking each caller's key first, see
relay.py) and reports the address and a token in its folder, as a pilot does. The container's root is a fresh overlay over the image when
the job runs as root; an unprivileged job runs the image read-only with a private /tmp
(bubblewrap and Charliecloud 0.31 have no unprivileged writable layer here; Apptainer's
``--writable-tmpfs`` gives one anywhere).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from orchard.agent import inroot
from orchard.agent.egress import Egress, choose_egress
from orchard.agent.host_ids import DEFAULT_HOST_UID, claim_host_ids
from orchard.agent.images import ImageStore, ResolvedImage
from orchard.agent.reaper import ChildReaper, run_tool
from orchard.agent.runtimes import bwrap
from orchard.agent.runtimes.api import DEFAULT_PATH
from orchard.agent.runtimes.layers import ensure_paths, overlay_root
from orchard.agent.runtimes.mounts import remove_tree, unmount
from orchard.agent.settings import AgentSettings
from orchard.errors import OrchardError
from orchard_slurm.pilot import write_stop_record
from orchard_slurm.relay import Relay, listening_socket
from orchard_slurm.runtimes import apptainer, charliecloud
from orchard_slurm.runtimes.charliecloud import CH_RUN_DIRS, CH_RUN_FILES
from orchard_slurm.runtimes.processes import first_descendant

AGENT_FD = 3  # the listening socket the job hands to the agent (see relay.py)
AGENT = ["/opt/orchard/bin/orchard-agent", "--runtime", "direct", "--state-dir", "/tmp/.orchard-agent",
         "--fd", str(AGENT_FD)]
CONTAINER_DIRS = ("opt/orchard", "root", *CH_RUN_DIRS)  # bind targets of the three tools


@dataclass
class SandboxJob:
    """Everything one per-job sandbox needs, pickled by submitit."""

    job_dir: str
    sandbox_id: str
    image: str
    runtime: str  # "bwrap", "charliecloud" or "apptainer"
    block_network: bool
    bundle: str
    host: Optional[str] = None
    image_cache: Optional[str] = None  # where docker:// images are unpacked (shared between jobs)
    image_policy: dict = field(default_factory=dict)  # SlurmConfig.image_policy()
    host_ids: tuple[int, int, int, int] = (DEFAULT_HOST_UID + 1, DEFAULT_HOST_UID + 1, 1, 65535)  # config's
    disk_bytes: Optional[int] = None  # the writable layer's tmpfs (root jobs): half the job's memory

    @property
    def image_owner(self) -> tuple[int, int]:
        """Who owns the shared image cache: the range's first ids, never a sandbox's."""
        return self.host_ids[0] - 1, self.host_ids[1] - 1


def container_argv(job: SandboxJob, root: Path, writable: bool) -> list[str]:
    """The command that starts the container with the agent as its main process, built by the
    same functions as the runtimes' sandboxes on pilots. Only the agent bundle is bound in
    (read-only); the agent's socket arrives as an inherited fd."""
    binds = {job.bundle: "/opt/orchard"}
    work = Path(job.job_dir) / "container"
    resolv_conf = work / "resolv.conf"  # the egress's name servers, for a sandbox with network
    if job.runtime == "bwrap":
        names = ["--ro-bind", str(resolv_conf), "/etc/resolv.conf"] if resolv_conf.exists() else []
        return ["bwrap", *bwrap.namespace_args(job.sandbox_id, True), "--as-pid-1",  # the agent (not dumpable)
                "--bind" if writable else "--ro-bind", str(root), "/", *bwrap.proc_args(work / "empty"),
                "--dev", "/dev", "--tmpfs", "/tmp", "--ro-bind", job.bundle, "/opt/orchard", *names, "--", *AGENT]
    if job.runtime == "charliecloud":
        if resolv_conf.exists():
            binds[str(resolv_conf)] = "/etc/resolv.conf"
        return charliecloud.container_args(work / "dev", root, binds, AGENT, writable)
    if job.runtime == "apptainer":
        from spython.main import get_client

        options = apptainer.container_options(job.sandbox_id, job.block_network,
                                              [f"{source}:{target}" for source, target in binds.items()],
                                              apptainer.pilot_has_gpus(dict(os.environ)), ["--writable-tmpfs"])
        return get_client(quiet=True)._init_command(["exec"], None) + options + [job.image, *AGENT]
    raise ValueError(f"per-job mode runs bwrap, charliecloud or apptainer containers, not {job.runtime!r}")


async def resolve_image(job: SandboxJob, reaper: ChildReaper) -> ResolvedImage:
    """A directory image as it is; ``docker://`` pulled and unpacked once into the shared
    cache by the agent's own image store (Apptainer pulls for itself)."""
    if job.runtime == "apptainer":
        return ResolvedImage(reference=job.image, kind="rootfs", rootfs=Path(job.image))
    cache = Path(job.image_cache or Path(job.job_dir).parent.parent / "image-cache")
    cache.mkdir(parents=True, exist_ok=True)
    store = ImageStore(cache, job.image_owner if os.geteuid() == 0 else None, job.image_policy, reaper)
    return await store.resolve(job.image)


def prepare_root(job: SandboxJob, image: ResolvedImage, work: Path,
                 ids: Optional[tuple[int, int]]) -> tuple[Path, bool, list[Path]]:
    """(root, writable, mounts to undo): an overlay over the image when we are root; the
    image itself, read-only, otherwise."""
    assert image.rootfs is not None
    if job.runtime == "apptainer":
        return image.rootfs, True, []
    if not image.rootfs.is_dir():
        raise FileNotFoundError(f"per-job image {job.image!r}: not a directory image")
    if os.geteuid() != 0:
        if job.image.startswith("docker://"):  # our own unpacked copy: give it the mount points
            ensure_paths(image.rootfs, CONTAINER_DIRS, CH_RUN_FILES)
        return image.rootfs, False, []
    mounts: list[Path] = []
    assert ids is not None  # root jobs claimed them
    # The layer is a tmpfs of half the job's memory (its pages are the job's memory anyway:
    # a full layer must leave the job room to run), never the shared filesystem: 3 GiB went
    # onto shared_dir from a job of 2 GB.
    root = overlay_root(image.rootfs, work, ids, job.disk_bytes, mounts, job.image_owner)
    ensure_paths(root, CONTAINER_DIRS, CH_RUN_FILES)
    inroot.chown(str(root), "/root", ids)  # the image's /root, even if it is a symlink
    return root, True, mounts


async def agent_ready(relay: Relay, exited: "asyncio.Future[int]", job_dir: Path) -> None:
    """Until the agent answers its health route (its socket accepts from the start)."""
    while True:
        if exited.done():
            raise RuntimeError(f"the container exited ({exited.result()}): "
                               f"{(job_dir / 'container.log').read_text(errors='replace')[-2000:]}")
        try:
            if (await asyncio.wait_for(relay.agent_request("GET", "/health"), 2))[0] == 200:
                return
        except (OSError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.05)


def run_sandbox_job(job: SandboxJob) -> None:
    asyncio.run(_run(job))


async def _run(job: SandboxJob) -> None:
    job_dir = Path(job.job_dir)
    agent_dir, work = job_dir / "agent", job_dir / "container"
    work.mkdir(mode=0o700, parents=True)  # private to the sandbox's uid (and root): uploads land below
    ids: Optional[tuple[int, int]] = None
    if os.geteuid() == 0:  # a free id on this node, held while the job runs (skipping accounts' ids)
        uid, gid, _held = claim_host_ids(*job.host_ids)
        ids = (uid, gid)
        os.chown(work, *ids)
    (work / "dev").mkdir()  # charliecloud's private /dev is built here
    (work / "empty").touch(mode=0o444)  # bwrap masks host-global /proc entries with it
    if ids is not None:
        os.chown(work / "dev", *ids)
    agent_dir.mkdir(exist_ok=True)
    loop = asyncio.get_running_loop()
    reaper = ChildReaper()  # the image store's tools and the container, each waited for once
    reaper.install(loop)
    egress = job_egress(job, reaper, work)
    log_fd = os.open(job_dir / "container.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    mounts: list[Path] = []
    container: Optional[int] = None
    exited: Optional["asyncio.Future[int]"] = None
    try:
        try:
            image = await resolve_image(job, reaper)
        except OrchardError as exc:
            os.write(log_fd, f"ImageRejected: {exc.message}\n".encode())
            raise
        root, writable, mounts = prepare_root(job, image, work, ids)
        token = secrets.token_urlsafe(32)
        # Dies with this job's process however it ends (kill -9 too), and never as real root.
        prefix = [str(Path(job.bundle) / "bin" / "orchard-enter"), "--die-with-parent"]
        if ids is not None:
            prefix += ["--uid", str(ids[0]), "--gid", str(ids[1])]
        prefix.append("--")
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "USER": "orchard", **image.env,
               "ORCHARD_AGENT_TOKEN": token}
        if image.workdir:
            env["ORCHARD_WORKDIR"] = image.workdir  # the direct runtime's default cwd
        if job.runtime == "apptainer":  # --containall starts from a clean environment
            env.update({f"APPTAINERENV_{key}": value for key, value in env.items() if key.startswith("ORCHARD_")})
        argv = [*prefix, *container_argv(job, root, writable)]
        executable = shutil.which(argv[0], path=DEFAULT_PATH + ":" + os.environ.get("PATH", "")) or argv[0]
        listener = listening_socket(job_dir / "relay")  # a directory the container never sees
        try:
            container = os.posix_spawn(executable, argv, {**os.environ, **env} if job.runtime == "apptainer" else env,
                                       file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                                                     (os.POSIX_SPAWN_DUP2, log_fd, 1), (os.POSIX_SPAWN_DUP2, log_fd, 2),
                                                     (os.POSIX_SPAWN_DUP2, listener.fileno(), AGENT_FD)],
                                       setsid=True)
        finally:
            listener.close()  # the agent holds it now
        exited = reaper.wait(container)
        stopping = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        loop.add_signal_handler(signal.SIGUSR2, lambda: (write_stop_record(job_dir, signal.SIGUSR2), stopping.set()))
        relay = Relay(job_dir / "relay" / "agent.sock", token, job.sandbox_id)
        await agent_ready(relay, exited, job_dir)
        holder = namespace_holder(container)  # the container's first process (its network is its own)
        if holder is None:
            raise OrchardError(f"sandbox {job.sandbox_id}: no process of its container has a namespace of its own")
        if job.runtime == "bwrap":  # bwrap's devpts has no max=, and the node's pool is every service's
            await limit_job_ptys(job, holder, reaper)
        if egress is not None:
            await egress.start()
            await egress.attach(job.sandbox_id, holder)
        host = job.host or socket.gethostname()
        server = await relay.start(host)
        port = server.sockets[0].getsockname()[1]
        token_path = agent_dir / "token"
        token_path.touch(mode=0o600)
        token_path.write_text(token)
        # Whole or not at all: the service polls for this file and reads it as soon as it exists.
        staging = agent_dir / "agent.json.partial"
        staging.write_text(json.dumps({"address": f"http://{host}:{port}", "pid": container}))
        os.replace(staging, agent_dir / "agent.json")
        await asyncio.wait([exited, loop.create_task(stopping.wait())], return_when=asyncio.FIRST_COMPLETED)
        server.close()
    finally:
        if container is not None and exited is not None and not exited.done():
            await stop_container(container, exited)
        if egress is not None:
            await egress.detach(job.sandbox_id)
            await egress.close()
        os.close(log_fd)
        for target in mounts:
            unmount(target)
        remove_tree(work)


def job_egress(job: SandboxJob, reaper: ChildReaper, work: Path) -> Optional[Egress]:
    """The way out of an open sandbox's container (the agent's egress, for this job alone,
    with the agent's default network settings); None when it blocks its network. Apptainer
    makes its own network namespaces and is left as it is (its open sandboxes share the node's)."""
    if job.block_network or job.runtime == "apptainer":
        return None
    job_id = hashlib.sha256(job.job_dir.encode()).hexdigest()[:10]
    egress = choose_egress(AgentSettings(state_dir=work / "agent-state"), reaper, job_id)
    text = egress.resolv_conf()
    if text is not None:
        (work / "resolv.conf").write_text(text)
        os.chmod(work / "resolv.conf", 0o644)
    return egress


async def limit_job_ptys(job: SandboxJob, holder: int, reaper: ChildReaper) -> None:
    """Cap the container's devpts at the agent's default ``sandbox_ptys`` (the bundle's orchard-enter)."""
    helper = str(Path(job.bundle) / "bin" / "orchard-enter")
    code, _, err = await run_tool(reaper, [helper, "--pts-max", str(AgentSettings.model_fields["sandbox_ptys"].default),
                                           "--target", str(holder)], {"PATH": DEFAULT_PATH})
    if code != 0:
        raise OrchardError(f"sandbox {job.sandbox_id}: cannot limit its terminals: {err.strip()}")


def namespace_holder(pid: int) -> Optional[int]:
    """The first process below ``pid`` in a network namespace other than this job's."""
    ours = os.stat("/proc/self/ns/net").st_ino
    return first_descendant(pid, lambda p: os.stat(f"/proc/{p}/ns/net").st_ino != ours)


async def stop_container(pid: int, exited: "asyncio.Future[int]") -> None:
    """SIGTERM (the agent deletes its sandbox on the way out), SIGKILL after 15 s."""
    try:
        os.killpg(pid, signal.SIGTERM)
        await asyncio.wait_for(asyncio.shield(exited), 15)
    except ProcessLookupError:
        pass
    except asyncio.TimeoutError:
        os.killpg(pid, signal.SIGKILL)
