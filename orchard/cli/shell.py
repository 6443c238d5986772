"""``orchard sandbox shell SBX``: an interactive terminal in a sandbox (raw mode, window
size, Ctrl-C to the sandbox, its exit code back), against a server or in process."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import termios
import tty
from typing import Any, Optional


async def run_shell(client: Any, sandbox_id: str, cmd: Optional[list[str]]) -> int:
    """Relay this terminal to an interactive process in the sandbox; returns its exit code."""
    sandbox = await client.get(sandbox_id)
    size = shutil.get_terminal_size()
    proc = await sandbox.pty(cmd, rows=size.lines, cols=size.columns, env={"TERM": os.environ.get("TERM", "xterm")})
    loop = asyncio.get_running_loop()
    interactive = sys.stdin.isatty()
    saved = termios.tcgetattr(sys.stdin.fileno()) if interactive else None
    stdin_data: asyncio.Queue[bytes] = asyncio.Queue(maxsize=64)

    def readable() -> None:
        data = os.read(sys.stdin.fileno(), 4096)
        if data:
            stdin_data.put_nowait(data) if not stdin_data.full() else None
        else:
            loop.remove_reader(sys.stdin.fileno())

    async def forward_stdin() -> None:
        while True:
            await proc.write_stdin(await stdin_data.get())

    def resized() -> None:
        new = shutil.get_terminal_size()
        loop.create_task(proc.resize(new.lines, new.columns))

    try:
        if interactive:
            tty.setraw(sys.stdin.fileno())  # Ctrl-C is a byte for the sandbox's terminal, not a signal here
            loop.add_signal_handler(signal.SIGWINCH, resized)
        loop.add_reader(sys.stdin.fileno(), readable)
        sender = loop.create_task(forward_stdin())
        while not proc.done:
            chunk = await proc.read()
            if chunk:
                os.write(sys.stdout.fileno(), chunk)
        sender.cancel()
    finally:
        loop.remove_reader(sys.stdin.fileno())
        if saved is not None:
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)
            loop.remove_signal_handler(signal.SIGWINCH)
        await proc.close()
    if proc.error is not None:
        raise proc.error
    code = proc.exit_code or 0
    return 128 - code if code < 0 else code
