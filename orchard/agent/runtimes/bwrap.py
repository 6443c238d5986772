"""``bwrap``: each sandbox is one set of namespaces held by a tiny holder process.

bubblewrap builds the sandbox (user, mount, PID, IPC, UTS and, unless asked
otherwise, network namespaces; all capabilities dropped; an unprivileged uid inside
that maps to an unprivileged uid outside), with ``orchard-enter --hold`` as its PID 1.
Every command then joins those namespaces through ``orchard-enter --target``, so a
server started by one command is reachable from the next, and killing the holder
kills everything in the sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Optional

from orchard.agent.files import SandboxFiles
from orchard.agent.images import ResolvedImage
from orchard.agent.runtimes.api import IsolationRuntime
from orchard.agent.runtimes.mounts import mount, unmount
from orchard.agent.sandbox import Placement, SandboxState
from orchard.errors import ImageRejected, QuotaExceeded, RuntimeUnavailable
from orchard.quantities import parse_bytes, parse_cpu

# Read-only host paths the ``host`` image exposes; nothing else of the host is visible.
# Of /etc only an allow-list is copied (see build_host_etc), and bound with a single mount.
HOST_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
HOST_ETC_ALLOWLIST = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf", "debian_version", "environment",
    "gai.conf", "gitconfig", "host.conf", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "login.defs",
    "magic", "mime.types", "nsswitch.conf", "os-release", "pki", "profile", "profile.d", "protocols", "python3",
    "python3.11", "services", "skel", "ssl", "terminfo", "timezone", "xdg",
)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_HOME = "/home/user"


def _size(value: Optional[str]) -> Optional[int]:
    return parse_bytes(value) if value else None


def build_host_etc(target: Path, generated: dict[str, str]) -> None:
    """Build the ``host`` image's /etc: copies of allow-listed host files plus generated
    passwd/group/hosts. A copy costs one bind mount per sandbox instead of ~30."""
    staging = target.with_name(target.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=0o755)
    for name in (*HOST_ETC_ALLOWLIST, "resolv.conf"):
        source = Path("/etc") / name
        try:
            if source.is_symlink():
                (staging / name).symlink_to(os.readlink(source))
            elif source.is_dir():
                shutil.copytree(source, staging / name, symlinks=True)
            elif source.is_file():
                shutil.copy2(source, staging / name)
        except OSError:
            continue  # unreadable or vanished: leave it out
    for name, text in generated.items():
        (staging / name).write_text(text)
        os.chmod(staging / name, 0o644)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)


class BwrapRuntime(IsolationRuntime):
    name = "bwrap"

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if shutil.which("bwrap") is None:
            return "bubblewrap is not installed (apt-get install bubblewrap); or ask for runtime 'direct' by name"
        return None

    # -- start ---------------------------------------------------------------------
    async def start(self, sandbox: SandboxState) -> None:
        settings = self.context.settings
        image = await self.context.images.resolve(sandbox.spec.image)
        privileged = os.geteuid() == 0
        owner = (settings.host_uid, settings.host_gid) if privileged else None
        spec = sandbox.spec
        disk = _size(spec.disk or settings.default_disk)
        placement = Placement(root="", uid=settings.sandbox_uid, gid=settings.sandbox_gid, file_owner=owner)
        sandbox.placement = placement  # attached first, so a failure below still gets cleaned up
        if image.kind == "host":
            args = self._host_image_args(disk)
            placement.default_cwd = "/workspace"
            placement.env = {"HOME": SANDBOX_HOME, "PATH": DEFAULT_PATH}
        else:
            args = self._rootfs_args(sandbox, image, disk, owner, placement)
        placement.env.setdefault("PATH", DEFAULT_PATH)
        placement.env.update(spec.env)
        if self.context.cgroups.available:
            sandbox.cgroup = self.context.cgroups.create(
                sandbox.sandbox_id, _size(spec.memory or settings.default_memory), spec.pids or settings.default_pids,
                parse_cpu(spec.cpu) if spec.cpu else None)
        elif spec.memory or spec.pids or spec.cpu:
            raise QuotaExceeded("resource limits were asked for, but no cgroup hierarchy is writable here")
        await self._spawn_holder(sandbox, args, owner)
        placement.shell = "bash" if self._has(placement, "/bin/bash") else "sh"

    def _namespace_args(self, sandbox: SandboxState) -> list[str]:
        settings = self.context.settings
        args = ["--unshare-user", "--uid", str(settings.sandbox_uid), "--gid", str(settings.sandbox_gid),
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--hostname", sandbox.sandbox_id[:63], "--die-with-parent", "--as-pid-1",
                "--cap-drop", "ALL", "--disable-userns"]
        if sandbox.spec.block_network:
            args.append("--unshare-net")
        return args

    def _host_image_args(self, disk: Optional[int]) -> list[str]:
        args: list[str] = []
        if disk:
            args += ["--size", str(disk)]
        args += ["--tmpfs", "/"]
        for path in HOST_SYSTEM_PATHS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for path in self.context.settings.host_paths:
            args += ["--ro-bind-try", path, path]
        args += ["--ro-bind", str(self.context.settings.share_dir / "etc"), "/etc"]  # one mount, built at start
        args += ["--dir", "/workspace", "--dir", SANDBOX_HOME, "--perms", "01777", "--dir", "/tmp",
                 "--perms", "01777", "--dir", "/var/tmp", "--proc", "/proc", "--dev", "/dev"]
        return args

    def _rootfs_args(self, sandbox: SandboxState, image: ResolvedImage, disk: Optional[int],
                     owner: Optional[tuple[int, int]], placement: Placement) -> list[str]:
        if owner is None:
            raise RuntimeUnavailable("root-filesystem images need a root agent (for the overlayfs writable layer)")
        assert image.rootfs is not None
        sandbox.state_dir.mkdir(mode=0o700)  # only images with a writable layer need one
        os.chown(sandbox.state_dir, *owner)
        layer, root = sandbox.state_dir / "layer", sandbox.state_dir / "root"
        layer.mkdir()
        root.mkdir()
        try:
            if disk:
                mount("tmpfs", layer, "tmpfs", f"size={disk},mode=0700,uid={owner[0]},gid={owner[1]}")
                placement.mounts.insert(0, layer)
            for sub in ("upper", "work"):
                (layer / sub).mkdir()
                os.chown(layer / sub, *owner)
            mount("overlay", root, "overlay",
                  f"lowerdir={image.rootfs},upperdir={layer / 'upper'},workdir={layer / 'work'}")
            placement.mounts.insert(0, root)
            os.chown(root, *owner)
        except OSError as exc:
            raise ImageRejected(f"cannot build the writable layer of {image.reference}: {exc}") from None
        placement.env = {"HOME": "/root", **image.env}
        workdir = image.workdir
        if not workdir or workdir == "/":
            workdir = "/workspace" if (root / "workspace").is_dir() else "/"
        placement.default_cwd = workdir
        return ["--bind", str(root), "/", "--proc", "/proc", "--dev", "/dev",
                "--ro-bind", str(self.context.settings.share_dir / "hosts"), "/etc/hosts"]

    async def _spawn_holder(self, sandbox: SandboxState, args: list[str], owner: Optional[tuple[int, int]]) -> None:
        helper = str(self.context.helper)
        prefix = [helper]
        if sandbox.cgroup is not None:
            for procs in sandbox.cgroup.procs_files:
                prefix += ["--cgroup", procs]
        if owner:
            prefix += ["--uid", str(owner[0]), "--gid", str(owner[1])]
        argv = [*prefix, "--", "bwrap", *self._namespace_args(sandbox), *args,
                "--ro-bind", helper, "/dev/.orchard-hold", "--info-fd", "4",
                "--", "/dev/.orchard-hold", "--hold", "--ready-fd", "3"]
        ready_r, ready_w = os.pipe()
        info_r, info_w = os.pipe()
        log_fd = os.memfd_create("holder-log", os.MFD_CLOEXEC)
        try:
            pid = os.posix_spawn(helper, argv, {"PATH": DEFAULT_PATH}, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1), (os.POSIX_SPAWN_DUP2, log_fd, 2),
                (os.POSIX_SPAWN_DUP2, ready_w, 3), (os.POSIX_SPAWN_DUP2, info_w, 4),
            ], setsid=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
        finally:
            for fd in (ready_w, info_w):
                os.close(fd)
        sandbox.placement.holder_pid = pid
        exited = self.context.reaper.wait(pid)
        try:
            ready = await asyncio.wait_for(self._read_ready(ready_r, exited), self.context.settings.ready_timeout)
            if not ready:
                message = os.pread(log_fd, 65536, 0).decode(errors="replace").strip() or "no message"
                raise RuntimeUnavailable(f"bubblewrap failed: {message}")
            info = json.loads(os.read(info_r, 65536).decode())
        except asyncio.TimeoutError:
            raise RuntimeUnavailable("sandbox holder did not become ready in time") from None
        finally:
            for fd in (ready_r, info_r, log_fd):
                os.close(fd)
        sandbox.placement.target_pid = int(info["child-pid"])
        sandbox.placement.root = f"/proc/{sandbox.placement.target_pid}/root"
        sandbox.holder_exit = exited

    async def _read_ready(self, fd: int, exited: "asyncio.Future[int]") -> bool:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait([readable, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(fd)
        return readable.done() and os.read(fd, 16) == b"ready\n"

    def _has(self, placement: Placement, path: str) -> bool:
        return SandboxFiles(placement.root, None).exists(path)

    # -- stop ----------------------------------------------------------------------
    async def stop(self, sandbox: SandboxState) -> None:
        placement = sandbox.placement
        if placement is not None:
            for pid in (placement.target_pid, placement.holder_pid):
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)  # PID 1 of the namespace: the kernel kills the rest
                    except ProcessLookupError:
                        pass
        exit_future = getattr(sandbox, "holder_exit", None)
        if exit_future is not None:
            try:
                await asyncio.wait_for(asyncio.shield(exit_future), 5)
            except asyncio.TimeoutError:
                pass
        if sandbox.cgroup is not None:
            for _ in range(50):
                sandbox.cgroup.kill_all()
                if sandbox.cgroup.remove():
                    break
                await asyncio.sleep(0.02)
        if placement is not None:
            for target in placement.mounts:
                unmount(target)
        shutil.rmtree(sandbox.state_dir, ignore_errors=True)
