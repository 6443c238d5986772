"""Edges of interactive processes, with a real terminal and stand-ins for the rest.

A client that leaves an interactive process leaves no read of its terminal behind:
``pump_output`` reads the terminal in a task of its own; when the client went, that task
used to stay, waiting on the master with a reader registered. It swallowed what the process
wrote while nobody was attached, and once the session closed the master, uvloop still watched
the number, so the next file call whose socket got it failed with EEXIST. The terminal here
is real; the websocket and session are stand-ins (nothing is sent before the cancel)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from types import SimpleNamespace

import uvloop

from orchard.agent.pty_process import PtyProcess, _pid_namespace
from orchard.agent.pty_route import pump_output


def test_a_detached_client_leaves_no_read_behind():
    async def main() -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        master, terminal = os.openpty()  # ``terminal``: what a background job in the sandbox still holds
        os.set_blocking(master, False)
        control, control_peer = socket.socketpair()
        process = PtyProcess(master, control, os.getpid(), os.getpid(), loop.create_future())
        supervisor = loop.create_future()
        session = SimpleNamespace(process=process, supervisor=supervisor, pending=b"", touch=lambda: None)
        output = asyncio.ensure_future(pump_output(SimpleNamespace(), session))
        await asyncio.sleep(0.05)
        output.cancel()  # drive(): the connection went
        await asyncio.sleep(0.05)
        reads = [t for t in asyncio.all_tasks() if "PtyProcess.read" in repr(t.get_coro())]
        os.write(terminal, b"written while detached\n")
        await asyncio.sleep(0.05)
        kept = os.read(master, 100)  # what a reattached client gets
        supervisor.set_result(0)
        process.close()
        ours, theirs = socket.socketpair()  # the master's number, most likely: still usable
        await asyncio.open_unix_connection(sock=ours)
        for end in (theirs, control_peer):
            end.close()
        os.close(terminal)
        return len(reads), kept

    reads, kept = uvloop.run(main())
    assert reads == 0
    assert kept == b"written while detached\r\n"


def test_a_signal_right_after_the_start_reaches_the_process():
    """The helper sends the child's pid as soon as it forks; the child's first step is setsid,
    so a signal sent at once could find no process group of that number and was dropped (a
    TERM right after init left ``sleep 300`` running: CI saw it). Here the process is never a
    group leader, the state that moment is in."""
    sleeper = subprocess.Popen(["sleep", "30"])  # in our process group, not its own
    try:
        async def main() -> None:
            loop = asyncio.get_running_loop()
            master, terminal = os.openpty()
            control, peer = socket.socketpair()
            process = PtyProcess(master, control, os.getpid(), sleeper.pid, loop.create_future(),
                                 pid_namespace=_pid_namespace(sleeper.pid))
            process.signal(signal.SIGTERM)
            process.close()
            os.close(terminal)
            peer.close()

        asyncio.run(main())
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
    finally:
        sleeper.kill()
