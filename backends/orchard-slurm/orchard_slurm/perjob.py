"""What runs inside a per-job Slurm job: one sandbox, which is one container with the
exec agent inside it (from the agent bundle, bound read-only at /opt/orchard).

For sites that want Slurm to account every sandbox. The agent listens on a Unix socket
in a host directory bound into the container, so the container can have a network
namespace with no interfaces at all when the sandbox blocks its network; this job
relays TCP on the compute node to that socket and reports the address and a token in
its folder, as a pilot does. The container's root is a fresh overlay over the image when
the job runs as root; an unprivileged job runs the image read-only with a private /tmp
(bubblewrap and Charliecloud 0.31 have no unprivileged writable layer here; Apptainer's
``--writable-tmpfs`` gives one anywhere).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from orchard.agent.images import ImageStore, ResolvedImage
from orchard.agent.reaper import ChildReaper
from orchard.agent.runtimes.api import DEFAULT_PATH
from orchard.agent.runtimes.layers import ensure_paths, overlay_root
from orchard.agent.runtimes.mounts import unmount
from orchard.errors import OrchardError
from orchard_slurm.pilot import write_stop_record
from orchard_slurm.runtimes.apptainer import pilot_has_gpus
from orchard_slurm.runtimes.charliecloud import CH_RUN_DIRS, CH_RUN_FILES

AGENT = ["/opt/orchard/bin/orchard-agent", "--runtime", "direct", "--state-dir", "/orchard-run/state",
         "--uds", "/orchard-run/agent.sock"]
UNPRIVILEGED = (100000, 100000)  # whom a root job runs the container as
CONTAINER_DIRS = ("opt/orchard", "orchard-run", "root", *CH_RUN_DIRS)  # bind targets of the three tools


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


def container_argv(job: SandboxJob, root: Path, run_dir: Path, writable: bool) -> list[str]:
    """The command that starts the container with the agent as its main process."""
    binds = {job.bundle: "/opt/orchard", str(run_dir): "/orchard-run"}
    if job.runtime == "bwrap":
        argv = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                "--hostname", job.sandbox_id[:63], "--bind" if writable else "--ro-bind", str(root), "/",
                "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--ro-bind", job.bundle, "/opt/orchard",
                "--bind", str(run_dir), "/orchard-run"]
        return argv + (["--unshare-net"] if job.block_network else []) + ["--", *AGENT]
    if job.runtime == "charliecloud":
        argv = ["unshare", "--user", "--map-current-user", "--pid", "--mount-proc", "--ipc", "--uts", "--fork",
                "--kill-child", *(["--net"] if job.block_network else []), "--", "ch-run", "--private-tmp"]
        argv += ["--write"] if writable else []
        for source, target in binds.items():
            argv += ["--bind", f"{source}:{target}"]
        return argv + [str(root), "--", *AGENT]
    if job.runtime == "apptainer":
        from spython.main import get_client

        options = ["--containall", "--no-home", "--writable-tmpfs", "--hostname", job.sandbox_id[:63]]
        for source, target in binds.items():
            options += ["--bind", f"{source}:{target}"]
        if job.block_network:
            options += ["--net", "--network", "none"]
        if pilot_has_gpus(dict(os.environ)):
            options.append("--nv")
        return get_client(quiet=True)._init_command(["exec"], None) + options + [job.image, *AGENT]
    raise ValueError(f"per-job mode runs bwrap, charliecloud or apptainer containers, not {job.runtime!r}")


async def resolve_image(job: SandboxJob, reaper: ChildReaper) -> ResolvedImage:
    """A directory image as it is; ``docker://`` pulled and unpacked once into the shared
    cache by the agent's own image store (Apptainer pulls for itself)."""
    if job.runtime == "apptainer":
        return ResolvedImage(reference=job.image, kind="rootfs", rootfs=Path(job.image))
    cache = Path(job.image_cache or Path(job.job_dir).parent.parent / "image-cache")
    cache.mkdir(parents=True, exist_ok=True)
    store = ImageStore(cache, UNPRIVILEGED if os.geteuid() == 0 else None, job.image_policy, reaper)
    return await store.resolve(job.image)


def prepare_root(job: SandboxJob, image: ResolvedImage, work: Path) -> tuple[Path, bool, list[Path]]:
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
    root = overlay_root(image.rootfs, work, UNPRIVILEGED, None, mounts)
    ensure_paths(root, CONTAINER_DIRS, CH_RUN_FILES)
    os.chown(root / "root", *UNPRIVILEGED)
    return root, True, mounts


async def relay(listen_host: str, socket_path: Path) -> asyncio.AbstractServer:
    """TCP on the compute node -> the agent's Unix socket inside the container."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def connect(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            agent_reader, agent_writer = await asyncio.open_unix_connection(str(socket_path))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, agent_writer), pipe(agent_reader, client_writer))

    return await asyncio.start_server(connect, listen_host, 0)


def run_sandbox_job(job: SandboxJob) -> None:
    asyncio.run(_run(job))


async def _run(job: SandboxJob) -> None:
    job_dir = Path(job.job_dir)
    agent_dir, work = job_dir / "agent", job_dir / "container"
    run_dir = work / "run"
    run_dir.mkdir(parents=True)
    agent_dir.mkdir(exist_ok=True)
    loop = asyncio.get_running_loop()
    reaper = ChildReaper()  # the image store's tools and the container, each waited for once
    reaper.install(loop)
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
        root, writable, mounts = prepare_root(job, image, work)
        token = secrets.token_urlsafe(32)
        prefix: list[str] = []
        if os.geteuid() == 0:  # never run the container as real root
            os.chown(run_dir, *UNPRIVILEGED)
            prefix = [str(Path(job.bundle) / "bin" / "orchard-enter"), "--uid", str(UNPRIVILEGED[0]),
                      "--gid", str(UNPRIVILEGED[1]), "--"]
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "USER": "orchard", **image.env,
               "ORCHARD_AGENT_TOKEN": token}
        if image.workdir:
            env["ORCHARD_WORKDIR"] = image.workdir  # the direct runtime's default cwd
        if job.runtime == "apptainer":  # --containall starts from a clean environment
            env.update({f"APPTAINERENV_{key}": value for key, value in env.items() if key.startswith("ORCHARD_")})
        argv = [*prefix, *container_argv(job, root, run_dir, writable)]
        executable = shutil.which(argv[0], path=DEFAULT_PATH + ":" + os.environ.get("PATH", "")) or argv[0]
        container = os.posix_spawn(executable, argv, {**os.environ, **env} if job.runtime == "apptainer" else env,
                                   file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                                                 (os.POSIX_SPAWN_DUP2, log_fd, 1), (os.POSIX_SPAWN_DUP2, log_fd, 2)],
                                   setsid=True)
        exited = reaper.wait(container)
        stopping = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        loop.add_signal_handler(signal.SIGUSR2, lambda: (write_stop_record(job_dir, signal.SIGUSR2), stopping.set()))
        socket_path = run_dir / "agent.sock"
        while not socket_path.exists():
            if exited.done():
                raise RuntimeError(f"the container exited ({exited.result()}): "
                                   f"{(job_dir / 'container.log').read_text(errors='replace')[-2000:]}")
            await asyncio.sleep(0.02)
        host = job.host or socket.gethostname()
        server = await relay(host, socket_path)
        port = server.sockets[0].getsockname()[1]
        token_path = agent_dir / "token"
        token_path.touch(mode=0o600)
        token_path.write_text(token)
        (agent_dir / "agent.json").write_text(json.dumps({"address": f"http://{host}:{port}", "pid": container}))
        await asyncio.wait([exited, loop.create_task(stopping.wait())], return_when=asyncio.FIRST_COMPLETED)
        server.close()
    finally:
        if container is not None and exited is not None and not exited.done():
            await stop_container(container, exited)
        os.close(log_fd)
        for target in mounts:
            unmount(target)
        shutil.rmtree(work, ignore_errors=True)


async def stop_container(pid: int, exited: "asyncio.Future[int]") -> None:
    """SIGTERM (the agent deletes its sandbox on the way out), SIGKILL after 15 s."""
    try:
        os.killpg(pid, signal.SIGTERM)
        await asyncio.wait_for(asyncio.shield(exited), 15)
    except ProcessLookupError:
        pass
    except asyncio.TimeoutError:
        os.killpg(pid, signal.SIGKILL)
