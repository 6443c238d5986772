"""``orchard doctor --backend local``: what the local backend's agent needs on this machine.

bubblewrap that can really make a user namespace as an unprivileged user (that is what the
agent asks of it: each sandbox runs under its own unprivileged uid), cgroups the agent can
write (limits), a C compiler for the ``orchard-enter`` helper, and skopeo + umoci for
``docker://`` images. Each probe runs the real thing where it can, not just ``which``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from orchard.backends.checks import Check, probe, tool_check, tools_check

USERNS_FIX = ("sysctl -w user.max_user_namespaces=15000 kernel.unprivileged_userns_clone=1 "
              "(Ubuntu 24.04+: also sysctl -w kernel.apparmor_restrict_unprivileged_userns=0)")
NOBODY = "65534"


def bwrap_userns_check() -> Check:
    """Can bubblewrap build a sandbox's namespaces? Tried as ``nobody`` under a root doctor,
    because a root agent runs bwrap as each sandbox's unprivileged uid."""
    if shutil.which("bwrap") is None:
        return Check("bubblewrap", False, "bwrap not found on PATH", "apt-get install bubblewrap")
    limit = Path("/proc/sys/user/max_user_namespaces")
    if limit.exists() and limit.read_text().strip() == "0":
        return Check("user namespaces", False, "user.max_user_namespaces is 0", USERNS_FIX)
    argv = ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true"]
    as_whom = "this user"
    if os.geteuid() == 0 and shutil.which("setpriv"):
        argv = ["setpriv", "--reuid", NOBODY, "--regid", NOBODY, "--clear-groups", "--", *argv]
        as_whom = "an unprivileged uid"
    ok, detail = probe(argv, timeout=20)
    return Check("user namespaces (bwrap)", ok, f"bwrap made a sandbox as {as_whom}" if ok else detail,
                 None if ok else USERNS_FIX)


def cgroup_check() -> Check:
    """Which cgroup version, and may the agent create groups in it (memory, pids, CPU limits)?"""
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        version, controllers = "v2", (root / "cgroup.controllers").read_text().split()
        missing = [c for c in ("memory", "pids", "cpu") if c not in controllers]
        target = root
    else:
        version = "v1"
        missing = [c for c in ("memory", "pids", "cpu") if not (root / c / "cgroup.procs").exists()]
        target = root / "memory"
    if missing:
        return Check(f"cgroups ({version})", False, f"controllers not available: {', '.join(missing)}",
                     "enable them on the kernel command line (e.g. cgroup_enable=memory) and reboot", required=False)
    if os.geteuid() != 0 or not os.access(target, os.W_OK):
        fix = ("run the agent as root (it creates one cgroup per sandbox); with systemd v2 a user agent needs "
               "Delegate=yes: systemd-run --user -p Delegate=yes --scope orchard agent serve")
        return Check(f"cgroups ({version})", False, f"{target} is not writable by this user: memory, pids and CPU "
                     "limits are refused", fix, required=False)
    return Check(f"cgroups ({version})", True, "memory, pids and cpu controllers writable")


def local_checks() -> list[Check]:
    """Everything the local backend needs; limits and ``docker://`` images are optional."""
    return [
        bwrap_userns_check(),
        tool_check("cc", "apt-get install gcc libc6-dev", why="builds the orchard-enter helper once"),
        cgroup_check(),
        tools_check("docker:// images", ("skopeo", "umoci"), "apt-get install skopeo umoci",
                    why="only for docker:// images", required=False),
    ]
