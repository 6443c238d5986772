"""``charliecloud``: each sandbox is a ``ch-run`` container held by ``orchard-enter --hold``.

ch-run gives a user and a mount namespace but shares the host's PID and network
namespaces. We wrap it in ``unshare`` (a user namespace of our own, so it works for
unprivileged pilots too) for PID, IPC, UTS and network namespaces (a sandbox with network
gets its way out from the agent's egress, as bubblewrap sandboxes do). Commands join
the holder with ``orchard-enter --target`` like bubblewrap sandboxes, so an exec costs
the same. Images are directory trees (the agent's image store unpacks ``docker://``
references); each sandbox writes to its own overlay layer (root agents).
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path
from typing import Optional

from orchard.agent import inroot
from orchard.agent.reaper import run_tool
from orchard.agent.runtimes.api import DEFAULT_PATH, IsolationRuntime
from orchard.agent.runtimes.holder import HOLD_ARGS, launcher_prefix, limit, spawn_holder, stop_held
from orchard.agent.runtimes.layers import ensure_paths, image_workdir, writable_root
from orchard.agent.runtimes.mounts import MASKED_PROC_DIRS, MASKED_PROC_FILES
from orchard.agent.sandbox import Placement, SandboxState
from orchard.errors import InvalidRequest, RuntimeUnavailable
from orchard.quantities import optional_bytes
from orchard_slurm.runtimes.processes import first_descendant

HOLD_PATH = "/.orchard-hold"  # bind target of the holder binary inside the container
CH_RUN_DIRS = ("dev", "proc", "sys", "tmp", "etc", "home", "mnt")
CH_RUN_FILES = ("etc/hosts", "etc/resolv.conf", "etc/passwd", "etc/group")


# ch-run binds the host's /dev (block devices, /dev/kvm, /dev/fuse, and a /dev/shm shared
# with every user of the node), /sys and /proc. In the namespaces unshare made, this puts a
# private, minimal /dev in their place first (a tmpfs with the usual character devices bound
# in and a /dev/shm of its own), mounts a sysfs of the sandbox's own network namespace over
# the node's (it lists the sandbox's interfaces only: the node's NICs, their statistics and
# /sys/devices/virtual/net are not there), hides the cgroup tree under an empty read-only
# tmpfs, masks host-global /proc entries and makes /proc/sys read-only (as bwrap sandboxes
# have them), brings loopback up, then drops the capabilities it needed and runs ch-run.
MINIMAL_DEV = """set -e
d="$1"; shift
mount -n -t tmpfs -o mode=0755,nosuid,size=64k tmpfs "$d"
for n in null zero full random urandom tty; do : > "$d/$n"; mount -n --bind "/dev/$n" "$d/$n"; done
mkdir "$d/shm" "$d/pts"
mount -n -t tmpfs -o mode=1777,nosuid,nodev,size=64m tmpfs "$d/shm"  # as Docker and Podman size it
ln -s /proc/self/fd "$d/fd"; ln -s /proc/self/fd/0 "$d/stdin"
ln -s /proc/self/fd/1 "$d/stdout"; ln -s /proc/self/fd/2 "$d/stderr"
mount -n --move "$d" /dev
mount -n -t sysfs -o ro,nosuid,nodev,noexec sysfs /sys  # of this network namespace: its interfaces only
[ -d /sys/fs/cgroup ] && mount -n -t tmpfs -o ro,mode=0555,size=4k tmpfs /sys/fs/cgroup  # others' cgroups
for masked in $MASKED_FILES; do [ -e "/proc/$masked" ] && mount -n --bind /dev/null "/proc/$masked"; done
for masked in $MASKED_DIRS; do [ -d "/proc/$masked" ] && mount -n -t tmpfs -o ro,size=4k tmpfs "/proc/$masked"; done
mount -n --bind /proc/sys /proc/sys && mount -n -o remount,bind,ro /proc/sys
ip link set lo up  # a new network namespace starts with loopback down
exec setpriv --inh-caps=-all --ambient-caps=-all -- "$@"
"""


def unshare_args() -> list[str]:
    """Namespaces ch-run does not make: PID (with its own /proc), IPC, UTS, cgroup and network,
    with network or without: an open sandbox gets its way out from the agent's egress
    (capabilities kept in the new user namespace for ``minimal_dev_args``, which drops them)."""
    return ["unshare", "--user", "--map-current-user", "--keep-caps", "--pid", "--mount-proc", "--ipc", "--uts",
            "--cgroup", "--net", "--fork", "--kill-child"]


def minimal_dev_args(staging: Path) -> list[str]:
    """Run what follows with a private minimal /dev built in ``staging`` (an empty directory)
    and the /sys, /proc and loopback described above."""
    return ["env", f"MASKED_FILES={' '.join(MASKED_PROC_FILES)}", f"MASKED_DIRS={' '.join(MASKED_PROC_DIRS)}",
            "sh", "-c", MINIMAL_DEV, "orchard-dev", str(staging)]


def ch_run_args(root: Path, binds: dict[str, str], command: list[str], writable: bool = True) -> list[str]:
    """ch-run on ``root`` with a private /tmp and ``binds`` (source: target). ``--no-passwd``:
    ch-run's own /etc/passwd and /etc/group are deleted, sandbox-writable copies in the node's
    /tmp, outside the disk quota (1 GiB went into one under ``disk: 64M``); the image's are used."""
    argv = ["ch-run", *(["--write"] if writable else []), "--private-tmp", "--no-passwd"]  # private: else the node's /tmp
    for source, target in binds.items():
        argv += ["--bind", f"{source}:{target}"]
    return [*argv, str(root), "--", *command]


def container_args(staging: Path, root: Path, binds: dict[str, str], command: list[str],
                   writable: bool = True) -> list[str]:
    """The whole container: namespaces, a private minimal /dev built in ``staging``, then ch-run.
    The same for a held sandbox on a pilot and a per-job container."""
    return [*unshare_args(), "--", *minimal_dev_args(staging), *ch_run_args(root, binds, command, writable)]


def find_holder(pid: int) -> Optional[int]:
    """The holder among ``pid``'s descendants (unshare forks it; ch-run execs into it)."""
    return first_descendant(pid, lambda p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0] == HOLD_PATH.encode())


class CharliecloudRuntime(IsolationRuntime):
    name = "charliecloud"

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        missing = [tool for tool in ("ch-run", "unshare", "setpriv", "mount", "ip") if shutil.which(tool) is None]
        if missing:
            return f"not installed: {', '.join(missing)} (apt-get install charliecloud-runtime util-linux iproute2)"
        return None

    async def start(self, sandbox: SandboxState) -> None:
        settings, spec = self.context.settings, sandbox.spec
        image = await self.context.images.resolve(spec.image)
        if image.kind == "host":
            raise InvalidRequest("the charliecloud runtime runs directory images: ask for a docker:// reference or "
                                 "an image directory, not 'host'")
        owner = sandbox.host_ids  # its own host ids under a root agent
        ids = owner or (os.getuid(), os.getgid())
        placement = Placement(root="", uid=ids[0], gid=ids[1])  # ch-run maps our uid to itself
        sandbox.placement = placement  # attached first, so a failure below still gets cleaned up
        disk = optional_bytes(spec.disk or settings.default_disk)
        root = writable_root(sandbox, image, disk, owner, placement, self.context.images.owner)
        ensure_paths(root, CH_RUN_DIRS, (*CH_RUN_FILES, HOLD_PATH.lstrip("/")))  # ch-run's bind targets
        if inroot.exists_in_root(str(root), "/root", directory=True):
            inroot.chown(str(root), "/root", ids)  # HOME, writable by the sandbox user (a copy-up in the overlay)
        placement.env = {"HOME": "/root", "PATH": DEFAULT_PATH, **image.env, **spec.env}
        placement.default_cwd = image_workdir(image, root)
        limit(self.context, sandbox)
        staging = sandbox.state_dir / "dev"
        staging.mkdir()
        if owner:
            os.chown(staging, *owner)
        binds = {str(self.context.helper): HOLD_PATH}
        egress = self.context.egress
        if egress.shares_host_network and not spec.block_network:
            raise InvalidRequest("block_network: false with network_egress 'host' is not offered by the charliecloud "
                                 "runtime (its sandboxes always have a network namespace of their own)")
        if not spec.block_network and egress.resolv_conf() is not None:
            binds[str(self.context.settings.share_dir / "resolv.conf")] = "/etc/resolv.conf"
        argv = [*launcher_prefix(self.context, sandbox, owner),
                *container_args(staging, root, binds, [HOLD_PATH, *HOLD_ARGS])]
        env = {"PATH": DEFAULT_PATH, "USER": pwd.getpwuid(ids[0]).pw_name if _known(ids[0]) else "orchard"}
        await spawn_holder(self.context, sandbox, [shutil.which(argv[0]) or argv[0], *argv[1:]], env, "ch-run")
        holder = find_holder(placement.holder_pid or 0)
        if holder is None:
            raise RuntimeUnavailable("ch-run started, but its holder process was not found")
        placement.target_pid = holder
        placement.root = f"/proc/{holder}/root"
        if not spec.block_network:
            await egress.attach(sandbox.sandbox_id, holder)
        if disk:  # ch-run's private /tmp is a tmpfs of no size: give it the sandbox's disk quota
            code, _, err = await run_tool(self.context.reaper, ["mount", "-N", str(holder), "-o",
                                                                f"remount,size={disk}", "/tmp"], {"PATH": DEFAULT_PATH})
            if code != 0:
                raise RuntimeUnavailable(f"cannot size the sandbox's /tmp to its disk quota: {err.strip()}")
        placement.shell = "bash" if inroot.exists_in_root(str(root), "/bin/bash") else "sh"

    async def stop(self, sandbox: SandboxState) -> None:
        await stop_held(sandbox)
        await self.context.egress.detach(sandbox.sandbox_id)


def _known(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False
