"""The idle, total and detach limits of interactive processes, on an agent of its own with
small settings (the shared test agent keeps the defaults: an hour, a day, 30 s)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from orchard.agent.settings import AgentSettings
from tests.pty_frames import Frames, open_socket

IDLE, TOTAL, GRACE = 2.0, 5.0, 1.0


@pytest.fixture(scope="module")
def limited(kit_image):
    from orchard.backends.local.launcher import ensure_agent, stop_agent

    settings = AgentSettings(state_dir=Path(kit_image).parent / "agent-pty-limits", image_dirs=[str(Path(kit_image).parent)],
                             pty_idle_timeout_seconds=IDLE, pty_max_seconds=TOTAL, pty_detach_grace_seconds=GRACE)
    endpoint = ensure_agent(settings)
    http = httpx.Client(transport=httpx.HTTPTransport(uds=endpoint.url.removeprefix("unix://")),
                        base_url="http://agent", headers={"X-API-Key": endpoint.token}, timeout=60)
    sandboxes = [http.post("/sandboxes", json={"image": kit_image}).json()["sandbox_id"] for _ in range(2)]
    try:
        yield endpoint.url, endpoint.token, http, sandboxes
    finally:
        for sid in sandboxes:
            http.delete(f"/sandboxes/{sid}")
        http.close()
        stop_agent(settings)


def _pty(limited, sid: str) -> Frames:
    url, key = limited[0], limited[1]
    return Frames(open_socket(url, f"/sandboxes/{sid}/exec/pty", key))


def _running(limited, sid: str, pattern: str) -> bool:
    result = limited[2].post(f"/sandboxes/{sid}/exec", json={"command": f"pgrep -f '{pattern}' >/dev/null", "wait": True}).json()
    return result["exit_code"] == 0


def test_an_idle_process_is_killed_after_the_idle_limit(limited):
    sid = limited[3][0]
    term = _pty(limited, sid)
    started = time.monotonic()
    assert term.init(["sleep", "301"])["type"] == "ready"
    frame = term.until_end(timeout=IDLE + 10)
    took = time.monotonic() - started
    assert frame["type"] == "error" and frame["error_type"] == "ExecTimeout", frame
    assert "pty_idle_timeout_seconds" in frame["message"]
    assert IDLE <= took < IDLE + 5, took
    assert not _running(limited, sid, "[s]leep 301")


def test_output_keeps_a_process_alive_until_the_total_limit(limited):
    sid = limited[3][0]
    term = _pty(limited, sid)
    started = time.monotonic()
    assert term.init(["bash", "-c", "while :; do echo tick; sleep 0.3; done"])["type"] == "ready"
    frame = term.until_end(timeout=TOTAL + 10)
    took = time.monotonic() - started
    assert frame["type"] == "error" and frame["error_type"] == "ExecTimeout", frame
    assert "pty_max_seconds" in frame["message"]  # not the idle limit: it kept printing
    assert TOTAL <= took < TOTAL + 5, took
    assert term.output.count(b"tick") > IDLE / 0.3


def test_input_counts_as_activity(limited):
    sid = limited[3][0]
    term = _pty(limited, sid)
    assert term.init(["bash", "-c", "stty -echo; while read line; do :; done"])["type"] == "ready"
    deadline = time.monotonic() + IDLE * 2
    while time.monotonic() < deadline:  # silent, but typed into: past the idle limit
        term.stdin("x\n")
        time.sleep(0.2)
    term.send(type="close")
    assert term.until_end()["type"] == "exit"


def test_a_dropped_connection_ends_the_process_after_the_grace(limited):
    sid, other = limited[3]
    term = _pty(limited, sid)
    session_id = term.init(["sleep", "302"])["session_id"]
    term.ws.close()  # no close frame: the network went
    # another sandbox cannot take it over meanwhile
    stranger = _pty(limited, other)
    stranger.send(type="init", attach=session_id)
    assert stranger.until_end()["type"] == "error"
    deadline = time.monotonic() + GRACE + 10
    while _running(limited, sid, "[s]leep 302"):
        assert time.monotonic() < deadline, "the process outlived its grace period"
        time.sleep(0.2)
    late = _pty(limited, sid)
    late.send(type="init", attach=session_id)
    frame = late.until_end()
    assert frame["type"] == "error" and "grace" in frame["message"]
