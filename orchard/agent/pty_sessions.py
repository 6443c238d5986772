"""The agent's table of interactive processes: caps, time limits, detach and reattach.

A process outlives its connection for ``pty_detach_grace_seconds`` so a client whose
network blinked can reattach (``init.attach``); while nobody is attached its output is not
read, so it stops at its next write once the terminal's buffer is full. Each process has
one supervisor task that enforces the idle, total and detach limits, whether or not a
client is attached, and a sandbox's processes end with the sandbox.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from orchard.agent.jobs import shell_argv
from orchard.agent.pty_process import PtyProcess
from orchard.agent.sandbox import SandboxState
from orchard.agent.settings import AgentSettings
from orchard.errors import ExecTimeout, InvalidRequest, OrchardError, QuotaExceeded, SandboxConflict, SandboxLost
from orchard.ptywire import InitFrame

if TYPE_CHECKING:
    from orchard.agent.service import AgentService

SUPERVISE_TICK = 1.0  # how often a supervisor looks at the clocks (limits are coarse)


@dataclass
class PtySession:
    session_id: str
    sandbox: SandboxState
    process: PtyProcess
    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    attached: bool = True
    detached_at: float = 0.0
    pending: bytes = b""  # output read but not yet delivered when a connection dropped
    ended_by: Optional[OrchardError] = None  # why the agent ended it, if it did
    supervisor: Optional["asyncio.Task[int]"] = None

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def end(self, reason: OrchardError) -> None:
        if self.ended_by is None:
            self.ended_by = reason
        self.process.kill()

    def outcome(self) -> Optional[OrchardError]:
        """The error the client gets instead of ``exit`` (None: the process just ended)."""
        if self.ended_by is not None:
            return self.ended_by
        sandbox = self.sandbox
        if sandbox.deleting or sandbox.status != "ready" or sandbox.restarting:
            detail = sandbox.status_message or ("deleted" if sandbox.deleting else sandbox.status)
            return SandboxLost(f"sandbox {sandbox.sandbox_id!r} ended under the process: {detail}")
        return None


class PtyTable:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.sessions: dict[str, PtySession] = {}
        self._reserved: dict[str, int] = {}  # per sandbox, spawns under way

    def count(self, sandbox_id: Optional[str] = None) -> int:
        live = [s for s in self.sessions.values() if sandbox_id is None or s.sandbox.sandbox_id == sandbox_id]
        reserved = sum(self._reserved.values()) if sandbox_id is None else self._reserved.get(sandbox_id, 0)
        return len(live) + reserved

    async def open(self, service: "AgentService", sandbox: SandboxState, init: InitFrame) -> PtySession:
        """Start a process for ``init``; refused with QuotaExceeded past the caps (counted
        before the first await, so a burst of connections cannot pass them)."""
        settings = self.settings
        sandbox_id = sandbox.sandbox_id
        if self.count(sandbox_id) >= settings.max_ptys_per_sandbox:
            raise QuotaExceeded(f"sandbox {sandbox_id!r} already has {settings.max_ptys_per_sandbox} interactive "
                                "processes open (max_ptys_per_sandbox)")
        if self.count() >= settings.max_ptys:
            raise QuotaExceeded(f"this agent already has {settings.max_ptys} interactive processes open (max_ptys)")
        placement = sandbox.placement
        assert placement is not None and service.runtime is not None
        cwd = service._resolve_cwd(sandbox, init.cwd)
        if init.cmd is None:
            argv = [placement.shell, "-l"] if init.login_shell else [placement.shell]
        elif init.login_shell:
            argv = shell_argv(placement.shell, shlex.join(init.cmd), True)
        else:
            argv = list(init.cmd)
        if any("\0" in part for part in argv) or any("\0" in k + v for k, v in (init.env or {}).items()):
            raise InvalidRequest("init frame: cmd/env: NUL bytes are not allowed")
        env = {"TERM": "xterm-256color", **placement.env, **(init.env or {})}
        self._reserved[sandbox_id] = self._reserved.get(sandbox_id, 0) + 1
        try:
            process = await PtyProcess.spawn(service.reaper, service.runtime, sandbox, argv, env, cwd,
                                             init.rows or 24, init.cols or 80)
        finally:
            self._reserved[sandbox_id] -= 1
            if not self._reserved[sandbox_id]:
                del self._reserved[sandbox_id]
        session = PtySession(session_id=f"pty-{secrets.token_hex(12)}", sandbox=sandbox, process=process)
        self.sessions[session.session_id] = session
        session.supervisor = asyncio.get_running_loop().create_task(self._supervise(session))
        if sandbox.status != "ready" or sandbox.deleting:  # it went while we spawned
            session.end(SandboxLost(f"sandbox {sandbox_id!r} ended while the process started"))
        return session

    def attach(self, sandbox_id: str, session_id: str) -> PtySession:
        session = self.sessions.get(session_id)
        if session is None or session.sandbox.sandbox_id != sandbox_id:
            raise InvalidRequest(f"init frame: attach: no interactive process {session_id!r} in sandbox {sandbox_id!r} "
                                 "(it ended, or its grace period passed)")
        if session.attached:
            raise SandboxConflict(f"interactive process {session_id!r} already has a client attached")
        session.attached = True
        session.touch()
        return session

    def detach(self, session: PtySession) -> None:
        session.attached = False
        session.detached_at = time.monotonic()

    def remove(self, session: PtySession) -> None:
        if self.sessions.pop(session.session_id, None) is not None:
            session.process.kill()
            if session.supervisor is not None and session.supervisor.done():
                session.process.close()

    def end_sandbox(self, sandbox_id: str, reason: OrchardError) -> None:
        """The sandbox is going: so are its processes, and their clients hear why."""
        for session in list(self.sessions.values()):
            if session.sandbox.sandbox_id == sandbox_id:
                session.end(reason)

    async def _supervise(self, session: PtySession) -> int:
        settings = self.settings
        waiting = asyncio.ensure_future(session.process.wait())
        while not waiting.done():
            now = time.monotonic()
            if now - session.started >= settings.pty_max_seconds:
                session.end(ExecTimeout(f"interactive process killed after {settings.pty_max_seconds:g}s "
                                        "(pty_max_seconds)"))
            elif now - session.last_activity >= settings.pty_idle_timeout_seconds:
                session.end(ExecTimeout(f"interactive process killed after {settings.pty_idle_timeout_seconds:g}s "
                                        "with no input or output (pty_idle_timeout_seconds)"))
            elif not session.attached and now - session.detached_at >= settings.pty_detach_grace_seconds:
                session.end(SandboxConflict("interactive process killed: its client went away and did not reattach"))
            await asyncio.wait([waiting], timeout=SUPERVISE_TICK)
        code = waiting.result()
        while not session.attached and session.session_id in self.sessions:  # its exit waits for a reattach
            if time.monotonic() - session.detached_at >= settings.pty_detach_grace_seconds:
                self.remove(session)
                break
            await asyncio.sleep(SUPERVISE_TICK)
        if session.session_id not in self.sessions:
            session.process.close()
        return code
