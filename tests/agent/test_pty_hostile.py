"""Hostile interactive processes: a flood to a reader that never reads, a burst of 100
terminals in one sandbox. The agent's memory stays bounded and it keeps serving."""

from __future__ import annotations

import concurrent.futures
import json
import time

from tests.agent.test_pty import pty
from tests.conftest import TEST_STATE_DIR


def _agent_rss_kib() -> int:
    pid = json.loads((TEST_STATE_DIR / "agent" / "agent.json").read_text())["pid"]
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:")).split()[1])


def test_a_flood_to_a_reader_that_never_reads(pty_agent, pty_sandbox):
    before = _agent_rss_kib()
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    term.init(["bash", "-c", "while :; do cat /dev/zero | head -c 1048576; done"])
    samples = []
    for _ in range(6):  # the writer blocks once the socket's and the terminal's buffers are full
        time.sleep(0.5)
        samples.append(_agent_rss_kib())
    assert max(samples) - before < 32 * 1024, f"agent RSS grew from {before} KiB: {samples}"
    term.ws.close()  # and the agent still serves others
    other = pty(pty_agent, pty_sandbox["sandbox_id"])
    other.init(["echo", "fine"])
    other.until_output("fine")


def test_a_hundred_terminals_at_once_hit_the_cap(pty_agent, kit_image):
    http = pty_agent[2]
    sid = http.post("/sandboxes", json={"image": kit_image}).json()["sandbox_id"]
    try:
        _hundred(pty_agent, sid)
    finally:
        http.delete(f"/sandboxes/{sid}")


def _hundred(pty_agent, sid: str) -> None:
    def one(_: int) -> dict:
        term = pty(pty_agent, sid)
        term.send(type="init", cmd=["sleep", "30"])
        frame = term.next()
        if frame["type"] == "ready":
            return {"term": term, **frame}
        term.ws.close()
        return frame

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        frames = list(pool.map(one, range(100)))
    ready = [f for f in frames if f["type"] == "ready"]
    refused = [f for f in frames if f["type"] == "error"]
    assert len(ready) == 16 and len(refused) == 84  # max_ptys_per_sandbox's default
    assert all(f["error_type"] == "QuotaExceeded" and "max_ptys_per_sandbox" in f["message"] for f in refused)
    for frame in ready:
        frame["term"].send(type="close")
        assert frame["term"].until_end()["type"] == "exit"
    # the slots come back once they are closed (the supervisor removes them at once)
    term = pty(pty_agent, sid)
    assert term.init(["true"])["type"] == "ready"
    assert term.until_end() == {"type": "exit", "code": 0}
