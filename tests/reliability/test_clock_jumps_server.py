"""Wall-clock steps under a real `orchard serve`: the server runs under libfaketime, whose
offset this test moves a day forward and a day back while the server runs (the agent,
started first, keeps the real clock). Live sandboxes are not reaped by the step forward, an
idle one is still reaped on time after the step back. test_clock_jumps.py checks the same
on the reconciler in process; this one checks the process as it ships."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from orchard.agent.settings import AgentSettings
from orchard.backends.local.launcher import ensure_agent, stop_agent
from tests.server.conftest import ServerProcess

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
TTL, ROUND = 3.0, 0.5


@pytest.fixture
def stepped_server(tmp_path):
    """(server, the file holding its clock's offset)."""
    if not LIBFAKETIME.exists():
        pytest.fail("needs libfaketime: run `make system-deps` (apt-get install libfaketime)")
    agent = AgentSettings(state_dir=Path(f"/tmp/orchard-clock-{os.getpid()}"), idle_exit_seconds=None)
    ensure_agent(agent)  # started here, outside libfaketime: only the server's clock moves
    offset = tmp_path / "offset"
    offset.write_text("+0\n")
    env = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME_TIMESTAMP_FILE": str(offset), "FAKETIME_NO_CACHE": "1",
           "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    server = ServerProcess(backend={"name": "local", "settings": {"agent": {"state_dir": str(agent.state_dir)}}},
                           env=env, reconciler={"interval": ROUND, "heartbeat_ttl": TTL, "lost_grace": 0})
    try:
        yield server, offset
    finally:
        server.cleanup()
        stop_agent(agent)


def _server_log_time(server: ServerProcess) -> float:
    """The time on the server's newest JSON log line: its wall clock, as the process reads it."""
    lines = [line for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    return json.loads(lines[-1])["time"]


def _listed(http, sandbox_id: str) -> bool:
    """Whether the server still has it (a listing: a call on the sandbox would count as a heartbeat)."""
    return sandbox_id in {s["sandbox_id"] for s in http.get("/sandboxes").json()["sandboxes"]}


def test_a_real_servers_wall_clock_stepped_forward_and_back(stepped_server):
    server, offset = stepped_server
    with server.http() as http:
        busy = http.post("/sandboxes", json={}).json()["sandbox_id"]
        idle = http.post("/sandboxes", json={}).json()["sandbox_id"]
        offset.write_text("+1d\n")  # an NTP step or `date -s` a day ahead
        http.post("/sandboxes/nope/heartbeat")  # a logged 404: the log shows the server's clock
        assert _server_log_time(server) - time.time() > 23 * 3600  # the step reached the server
        for _ in range(int(1.5 / 0.25)):  # three rounds past the step, well inside the TTL
            assert http.post(f"/sandboxes/{busy}/heartbeat").status_code == 200
            time.sleep(0.25)
        assert _listed(http, idle), "a day's step forward reaped a sandbox idle for 2 s"
        deadline = time.monotonic() + TTL + 4 * ROUND + 5
        while _listed(http, idle):  # still reaped on time: its TTL on the monotonic clock
            assert time.monotonic() < deadline, "the idle sandbox outlived its TTL"
            assert http.post(f"/sandboxes/{busy}/heartbeat").status_code == 200
            time.sleep(0.25)
        offset.write_text("-1d\n")  # and a day back
        late = http.post("/sandboxes", json={}).json()["sandbox_id"]
        started = time.monotonic()
        while _listed(http, late):
            assert time.monotonic() - started < TTL + 4 * ROUND + 5, "a day's step back kept an idle sandbox"
            assert http.post(f"/sandboxes/{busy}/heartbeat").status_code == 200
            time.sleep(0.25)
        assert time.monotonic() - started >= TTL - ROUND  # not before its TTL either
        assert http.get(f"/sandboxes/{busy}").json()["status"] == "ready"
        assert http.delete(f"/sandboxes/{busy}").status_code in (200, 204)
