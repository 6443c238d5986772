"""Sandboxes held by one long-lived process: ``orchard-enter --hold`` as PID 1 of the
sandbox's namespaces, started through a container tool (bubblewrap, ch-run, ...).

Every command then joins the holder's namespaces with ``orchard-enter --target``, so an
exec costs a fork and a few setns calls whatever tool built the sandbox, and killing the
holder kills everything in it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Optional

from orchard.agent.reaper import run_tool
from orchard.agent.runtimes.api import DEFAULT_PATH, RuntimeContext, open_files_args
from orchard.agent.runtimes.mounts import remove_tree, unmount
from orchard.agent.sandbox import SandboxState
from orchard.errors import QuotaExceeded, RuntimeUnavailable
from orchard.quantities import optional_bytes, parse_cpu

CGROUP_REMOVE_PATIENCE = 10.0  # seconds a deleted sandbox's cgroup may take to empty
log = logging.getLogger("orchard.agent")

HOLD_ARGS = ["--hold", "--ready-fd", "3"]  # what follows the holder's path inside the sandbox


def launcher_prefix(context: RuntimeContext, sandbox: Optional[SandboxState],
                    owner: Optional[tuple[int, int]]) -> list[str]:
    """``orchard-enter`` putting the tool into the sandbox's cgroup, as ``owner`` when given,
    killed if the agent dies (so no sandbox outlives its agent, even one killed with -9)."""
    prefix = [str(context.helper), "--die-with-parent", *open_files_args(context)]
    if sandbox is not None and sandbox.cgroup is not None:
        for procs in sandbox.cgroup.procs_files:
            prefix += ["--cgroup", procs]
    if owner:
        prefix += ["--uid", str(owner[0]), "--gid", str(owner[1])]
    return [*prefix, "--"]


def limit(context: RuntimeContext, sandbox: SandboxState) -> None:
    """Give the sandbox its cgroup: its own limits, else the agent's defaults; asking for
    limits where no cgroup hierarchy is writable is an error, never ignored."""
    settings, spec = context.settings, sandbox.spec
    if context.cgroups.available:
        cpu = spec.cpu or settings.default_cpu
        sandbox.cgroup = context.cgroups.create(
            sandbox.sandbox_id, optional_bytes(spec.memory or settings.default_memory),
            spec.pids or settings.default_pids, parse_cpu(cpu) if cpu else None,
            optional_bytes(settings.sandbox_socket_memory))
    elif spec.memory or spec.pids or spec.cpu:
        raise QuotaExceeded("resource limits were asked for, but no cgroup hierarchy is writable here")


async def limit_ptys(context: RuntimeContext, pid: int) -> None:
    """Cap the devpts of the sandbox ``pid`` holds at ``sandbox_ptys`` terminals (``orchard-enter
    --pts-max``): the kernel's pool is the host's, and one sandbox took 3,071 of it."""
    argv = [str(context.helper), "--pts-max", str(context.settings.sandbox_ptys), "--target", str(pid)]
    code, _, err = await run_tool(context.reaper, argv, {"PATH": DEFAULT_PATH})
    if code != 0:
        raise RuntimeUnavailable(f"cannot limit the sandbox's terminals: {err.strip()}")


async def spawn_holder(context: RuntimeContext, sandbox: SandboxState, argv: list[str], env: dict[str, str],
                       tool: str, info_fd: bool = False, pass_fds: Optional[dict[int, int]] = None) -> bytes:
    """Spawn ``argv`` (ending in the holder, which writes "ready" to fd 3) and wait until the
    holder is ready; raise RuntimeUnavailable with the tool's own message if it is not.
    Returns what the tool wrote to fd 4 when ``info_fd`` (bubblewrap's --info-fd).
    ``pass_fds`` {our fd: its number in the tool} hands descriptors to the tool alone."""
    assert sandbox.placement is not None
    ready_r, ready_w = os.pipe()
    info_r, info_w = os.pipe()
    log_fd = os.memfd_create("holder-log", os.MFD_CLOEXEC)
    actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
               (os.POSIX_SPAWN_DUP2, log_fd, 1), (os.POSIX_SPAWN_DUP2, log_fd, 2), (os.POSIX_SPAWN_DUP2, ready_w, 3)]
    if info_fd:
        actions.append((os.POSIX_SPAWN_DUP2, info_w, 4))
    actions += [(os.POSIX_SPAWN_DUP2, ours, theirs) for ours, theirs in (pass_fds or {}).items()]
    try:
        pid = os.posix_spawn(argv[0], argv, env, file_actions=actions, setsid=True,
                             setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError:
        for fd in (ready_r, info_r, log_fd):
            os.close(fd)
        raise
    finally:
        for fd in (ready_w, info_w):
            os.close(fd)
    sandbox.placement.holder_pid = pid
    exited = context.reaper.wait(pid)
    try:
        ready = await asyncio.wait_for(read_when_ready(ready_r, exited), context.settings.ready_timeout) == b"ready\n"
        if not ready:
            message = os.pread(log_fd, 65536, 0).decode(errors="replace").strip() or "no message"
            raise RuntimeUnavailable(f"{tool} failed: {message}")
        info = os.read(info_r, 65536) if info_fd else b""
    except asyncio.TimeoutError:
        raise RuntimeUnavailable("sandbox holder did not become ready in time") from None
    finally:
        for fd in (ready_r, info_r, log_fd):
            os.close(fd)
    sandbox.holder_exit = exited
    return info


async def read_when_ready(fd: int, exited: "asyncio.Future[int]") -> bytes:
    """What a starting child writes on its ready pipe ``fd``; b"" if it exits first."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        await asyncio.wait([readable, exited], return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(fd)
    return os.read(fd, 16) if readable.done() else b""


async def stop_held(sandbox: SandboxState, keep_layer: Optional[Path] = None) -> None:
    """Kill the holder (PID 1 of the namespace: the kernel kills the rest), then remove
    the sandbox's cgroup, mounts and state directory. ``keep_layer``: move the state
    directory there instead, with the writable layer (and its tmpfs) still in it (a snapshot)."""
    placement = sandbox.placement
    # The holder first: the tool that started it (bubblewrap) reaps it and exits. Killed
    # together, the tool may die first and leave the holder to us, a zombie until the
    # reaper's next sweep where children are watched by pidfd (reaper.py).
    for pid, grace in ((placement.target_pid, 1.0), (placement.holder_pid, 5.0)) if placement is not None else ():
        if not pid or (sandbox.holder_exit is not None and sandbox.holder_exit.done()):
            continue  # once it exited, its pids may already be another process's
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if sandbox.holder_exit is not None:
            try:
                await asyncio.wait_for(asyncio.shield(sandbox.holder_exit), grace)
            except asyncio.TimeoutError:
                pass
    if sandbox.cgroup is not None:  # killed processes can take seconds to leave on a loaded machine
        deadline, pause = time.monotonic() + CGROUP_REMOVE_PATIENCE, 0.02
        while True:
            sandbox.cgroup.kill_all()
            if sandbox.cgroup.remove():
                break
            if time.monotonic() > deadline:
                log.warning("sandbox %s: its cgroup still holds processes after %.0f s; left for the agent's "
                            "sweep of leftover cgroups (setting cgroup_sweep_seconds)",
                            sandbox.sandbox_id, CGROUP_REMOVE_PATIENCE)
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.25)
    if placement is not None:
        for target in placement.mounts:
            if keep_layer is None or target != placement.layer:
                unmount(target)
    if keep_layer is not None:
        os.rename(sandbox.state_dir, keep_layer)
        return
    remove_tree(sandbox.state_dir)
