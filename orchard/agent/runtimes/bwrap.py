"""``bwrap``: each sandbox is one set of namespaces held by a tiny holder process.

bubblewrap builds the sandbox (user, mount, PID, IPC, UTS and, unless asked
otherwise, network namespaces; all capabilities dropped; an unprivileged uid inside
that maps to an unprivileged uid outside), with ``orchard-enter --hold`` as its PID 1.
Every command then joins those namespaces through ``orchard-enter --target``, so a
server started by one command is reachable from the next, and killing the holder
kills everything in the sandbox.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from orchard.agent.images import ResolvedImage
from orchard.agent.inroot import exists_in_root
from orchard.agent.runtimes.api import DEFAULT_PATH, IsolationRuntime, RuntimeContext
from orchard.agent.runtimes.holder import HOLD_ARGS, launcher_prefix, limit, limit_ptys, spawn_holder, stop_held
from orchard.agent.runtimes.layers import image_workdir, writable_root
from orchard.agent.runtimes.mounts import MASKED_PROC_DIRS, MASKED_PROC_FILES, system_binds
from orchard.agent.sandbox import Placement, SandboxState
from orchard.agent.spawner import SPAWNER_FD, SpawnerClient, prestartable, socket_pair
from orchard.errors import Unsupported
from orchard.quantities import optional_bytes

# The ``host`` image shows the system directories (mounts.system_binds) and, of /etc, only an
# allow-list, copied (see build_host_etc) and bound with a single mount.
HOST_ETC_ALLOWLIST = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf", "debian_version", "environment",
    "gai.conf", "gitconfig", "host.conf", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "login.defs",
    "magic", "mime.types", "nsswitch.conf", "os-release", "pki", "profile", "profile.d", "protocols", "python3",
    "python3.11", "services", "skel", "ssl", "terminfo", "timezone", "xdg",
)
SANDBOX_HOME = "/home/user"


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


def namespace_args(hostname: str, own_network: bool, ids: Optional[tuple[int, int]] = None) -> list[str]:
    """Every namespace but the mount one (bwrap makes that anyway), all capabilities dropped
    and no further user namespaces: the same for a held sandbox and a per-job container.
    ``own_network``: a network namespace of its own (with loopback only, until an egress
    gives it a way out). ``ids``: who the sandbox user is inside (default: whoever bwrap runs as)."""
    args = ["--unshare-user"]
    if ids is not None:
        args += ["--uid", str(ids[0]), "--gid", str(ids[1])]
    args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", hostname[:63],
             "--die-with-parent", "--cap-drop", "ALL", "--disable-userns"]
    return args + (["--unshare-net"] if own_network else [])


READ_ONLY_DEV = ["--remount-ro", "/dev"]  # last: the holder's bind target is made in /dev first
SHM_BYTES = 64 << 20  # /dev/shm, as Docker and Podman size it (never more than the disk quota)


def dev_args(disk: Optional[int]) -> list[str]:
    """A fresh /dev with a /dev/shm of its own size: bwrap's /dev is a tmpfs of no size that
    the sandbox user owns, and its /dev/shm a directory of it (64 MiB went into /dev/shm, and
    200 MiB in 20,000 files into /dev itself, under disk: 16Mi). /dev is made read-only once
    the holder is bound into it (``READ_ONLY_DEV``); the device nodes, devpts and /dev/shm
    are mounts of their own and stay writable."""
    size = min(SHM_BYTES, disk) if disk else SHM_BYTES
    return ["--dev", "/dev", "--perms", "01777", "--size", str(size), "--tmpfs", "/dev/shm"]


def proc_args(empty_file: Path) -> list[str]:
    """A fresh /proc with /proc/sys read-only and the host-global entries masked (under
    ``empty_file``, an empty read-only file)."""
    args = ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys"]
    for name in MASKED_PROC_FILES:
        if os.path.exists(f"/proc/{name}"):  # the sandbox's /proc is this kernel's: same entries
            args += ["--ro-bind", str(empty_file), f"/proc/{name}"]
    for name in MASKED_PROC_DIRS:
        if os.path.isdir(f"/proc/{name}"):
            args += ["--tmpfs", f"/proc/{name}", "--remount-ro", f"/proc/{name}"]
    return args


class BwrapRuntime(IsolationRuntime):
    name = "bwrap"
    snapshots = True

    def __init__(self, context: RuntimeContext) -> None:
        super().__init__(context)
        self._spawners: dict[str, tuple[Placement, SpawnerClient]] = {}  # by sandbox id, while its holder lives

    def spawner(self, sandbox: SandboxState) -> Optional[SpawnerClient]:
        entry = self._spawners.get(sandbox.sandbox_id)
        if entry is None or entry[0] is not sandbox.placement or not entry[1].alive:
            return None
        return entry[1]

    def _drop_spawner(self, sandbox: SandboxState) -> None:
        entry = self._spawners.pop(sandbox.sandbox_id, None)
        if entry is not None:
            entry[1].close()

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if shutil.which("bwrap") is None:
            return "bubblewrap is not installed (apt-get install bubblewrap); or ask for runtime 'direct' by name"
        return None

    # -- start ---------------------------------------------------------------------
    async def start(self, sandbox: SandboxState) -> None:
        settings = self.context.settings
        image = await self.context.images.resolve(sandbox.spec.image)
        owner = sandbox.host_ids  # its own host ids under a root agent, else None (we are who we are)
        spec = sandbox.spec
        disk = optional_bytes(spec.disk or settings.default_disk)
        placement = Placement(root="", uid=settings.sandbox_uid, gid=settings.sandbox_gid)
        sandbox.placement = placement  # attached first, so a failure below still gets cleaned up
        if image.kind == "host":
            args = self._host_image_args(disk)
            placement.default_cwd = "/workspace"
            placement.env = {"HOME": SANDBOX_HOME, "PATH": DEFAULT_PATH}
        else:
            args = self._rootfs_args(sandbox, image, disk, owner, placement)
        placement.env.setdefault("PATH", DEFAULT_PATH)
        placement.env.update(spec.env)
        limit(self.context, sandbox)
        await self._spawn_holder(sandbox, args, owner)
        placement.shell = "bash" if self._has(placement, "/bin/bash") else "sh"

    def _host_image_args(self, disk: Optional[int]) -> list[str]:
        args: list[str] = []
        if disk:
            args += ["--size", str(disk)]
        args += ["--tmpfs", "/", *system_binds()]
        for path in self.context.settings.host_paths:
            args += ["--ro-bind-try", path, path]
        args += ["--ro-bind", str(self.context.settings.share_dir / "etc"), "/etc"]  # one mount, built at start
        args += ["--dir", "/workspace", "--dir", SANDBOX_HOME, "--perms", "01777", "--dir", "/tmp",
                 "--perms", "01777", "--dir", "/var/tmp", *self._proc_args(), *dev_args(disk)]
        return args

    def _proc_args(self) -> list[str]:
        return proc_args(self.context.settings.share_dir / "empty")

    def _rootfs_args(self, sandbox: SandboxState, image: ResolvedImage, disk: Optional[int],
                     owner: Optional[tuple[int, int]], placement: Placement) -> list[str]:
        base = sandbox.base.layers if sandbox.base is not None else ()
        root = writable_root(sandbox, image, disk, owner, placement, self.context.images.owner, base)
        placement.env = {"HOME": "/root", **image.env}
        placement.default_cwd = image_workdir(image, root)
        args = ["--bind", str(root), "/", *self._proc_args(), *dev_args(disk),
                "--ro-bind", str(self.context.settings.share_dir / "hosts"), "/etc/hosts"]
        if not sandbox.spec.block_network and self.context.egress.resolv_conf() is not None:
            args += ["--ro-bind", str(self.context.settings.share_dir / "resolv.conf"), "/etc/resolv.conf"]
        return args

    async def _spawn_holder(self, sandbox: SandboxState, args: list[str], owner: Optional[tuple[int, int]]) -> None:
        helper = str(self.context.helper)
        settings = self.context.settings
        egress = self.context.egress
        open_network = not sandbox.spec.block_network
        namespaces = namespace_args(sandbox.sandbox_id, not (open_network and egress.shares_host_network),
                                    (settings.sandbox_uid, settings.sandbox_gid))
        hold_args = HOLD_ARGS
        pair = socket_pair() if settings.spawner else None
        if pair is not None:  # the holder's end passes through bwrap as an inherited descriptor, never a path
            hold_args = [*HOLD_ARGS, "--spawner", str(SPAWNER_FD)]
        argv = [*launcher_prefix(self.context, sandbox, owner), "bwrap", *namespaces, "--as-pid-1", *args,
                "--ro-bind", helper, "/dev/.orchard-hold", *READ_ONLY_DEV, "--info-fd", "4", "--", "/dev/.orchard-hold",
                *hold_args]
        try:
            info = json.loads(await spawn_holder(self.context, sandbox, argv, {"PATH": DEFAULT_PATH}, "bubblewrap",
                                                 info_fd=True, pass_fds={pair[1].fileno(): SPAWNER_FD} if pair else None))
        except BaseException:
            if pair is not None:
                pair[0].close()
            raise
        finally:
            if pair is not None:
                pair[1].close()
        assert sandbox.placement is not None
        sandbox.placement.target_pid = int(info["child-pid"])
        sandbox.placement.root = f"/proc/{sandbox.placement.target_pid}/root"
        await limit_ptys(self.context, sandbox.placement.target_pid)
        if open_network:
            try:
                await egress.attach(sandbox.sandbox_id, sandbox.placement.target_pid)
            except BaseException:
                if pair is not None:
                    pair[0].close()
                raise
        if pair is not None:
            self._drop_spawner(sandbox)
            try:
                env = sandbox.placement.env
                prestart = settings.prestart_shell and sandbox.placement.shell == "bash" and prestartable(env)
                shell_env = dict(env) if prestart else None
                client = SpawnerClient(pair[0], sandbox.placement.target_pid, sandbox.cgroup, shell_env)
                self._spawners[sandbox.sandbox_id] = (sandbox.placement, client)
            except OSError:  # the holder is already gone: commands will find the sandbox lost
                pair[0].close()

    def _has(self, placement: Placement, path: str) -> bool:
        return exists_in_root(placement.root, path)

    # -- stop ----------------------------------------------------------------------
    async def stop(self, sandbox: SandboxState) -> None:
        self._drop_spawner(sandbox)
        await stop_held(sandbox)
        await self.context.egress.detach(sandbox.sandbox_id)

    async def freeze(self, sandbox: SandboxState, directory: Path) -> Path:
        assert sandbox.placement is not None
        if sandbox.placement.layer is None:
            raise Unsupported(f"sandbox {sandbox.sandbox_id!r} has no writable layer to snapshot (image "
                              f"{sandbox.spec.image!r}; snapshots need a directory or docker:// image and a root agent)")
        self._drop_spawner(sandbox)
        await stop_held(sandbox, keep_layer=directory)
        await self.context.egress.detach(sandbox.sandbox_id)
        return directory / "layer" / "upper"
