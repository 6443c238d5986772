"""``orchard serve`` as a child process on loopback, for benchmarks that measure through the server."""

from __future__ import annotations

import asyncio
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """``orchard serve`` with ``backend`` (``{name, settings}``), its state and log in ``directory``."""

    def __init__(self, backend: dict[str, Any], directory: Path) -> None:
        import yaml

        self.port, self.api_key = free_port(), secrets.token_hex(16)
        config = {"host": "127.0.0.1", "port": self.port, "api_key": self.api_key, "log_level": "warning",
                  "state": str(directory / "server.db"), "backend": backend}
        path = directory / "server.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = directory / "server.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "orchard.cli", "serve", "--config", str(path)],
                                            stdout=subprocess.DEVNULL, stderr=log)
        self.url = f"http://127.0.0.1:{self.port}"

    async def wait_ready(self, timeout: float = 60) -> None:
        """Until ``/health`` answers; the server's own log tail if it exits first."""
        import httpx

        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"orchard serve exited with {self.process.returncode}: "
                                       f"{self.log.read_text(errors='replace')[-2000:]}")
                try:
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError("orchard serve did not become ready")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
