"""A real `orchard serve` process on loopback, with its own agent and SQLite file."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import httpx
import pytest
import yaml

from tests.images import free_port

API_KEY = "test-key-123"
_counter = itertools.count()


class ServerProcess:
    def __init__(self, backend: Optional[dict[str, Any]] = None, env: Optional[dict[str, str]] = None,
                 **settings: Any) -> None:
        self.env = {**os.environ, **(env or {})}  # e.g. libfaketime for the server alone
        self.root = Path(f"/tmp/orchard-srv-{os.getpid()}-{next(_counter)}")
        self.root.mkdir(mode=0o755)
        self.agent_state = self.root / "agent"
        self.port = free_port()
        self.url = f"{'https' if settings.get('tls_cert') else 'http'}://127.0.0.1:{self.port}"
        config = {"port": self.port, "api_key": API_KEY, "state": str(self.root / "server.db"),
                  "backend": backend or {"name": "local", "settings": {"agent": {"state_dir": str(self.agent_state)}}},
                  "log_level": "info", **settings}
        self.config_path = self.root / "orchard.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = self.root / "server.log"
        self.process: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "orchard.cli", "serve", "--config", str(self.config_path)],
                                        stdout=log, stderr=log, start_new_session=True, env=self.env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1, verify=False).status_code == 200:  # up; TLS is the test's
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def http(self, api_key: Optional[str] = API_KEY) -> httpx.Client:
        headers = {"X-API-Key": api_key} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def client(self):
        from orchard.client import Client

        return Client(self.url, API_KEY)

    def agent_pid(self) -> int:
        import json

        return int(json.loads((self.agent_state / "agent" / "agent.json").read_text())["pid"])

    def cleanup(self) -> None:
        from orchard.agent.settings import AgentSettings
        from orchard.backends.local.launcher import stop_agent

        self.stop()
        if (self.agent_state / "agent").exists():
            stop_agent(AgentSettings(state_dir=self.agent_state))
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def server_factory():
    started: list[ServerProcess] = []

    def make(**kwargs: Any) -> ServerProcess:
        server = ServerProcess(**kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        if os.environ.get("ORCHARD_KEEP_SERVER_LOGS"):
            shutil.copy(server.log_path, "/tmp/last-server.log")
        server.cleanup()


@pytest.fixture(scope="module")
def server():
    process = ServerProcess()
    yield process
    process.cleanup()
