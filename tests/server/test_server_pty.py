"""``WS /sandboxes/{id}/exec/pty`` through `orchard serve` (real HTTP and WebSocket, a real
agent behind it), with a plain WebSocket client and exactly the original's frames."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.agent.settings import AgentSettings
from tests.pty_frames import Frames, open_socket, python_repl
from tests.server.conftest import API_KEY, ServerProcess


@pytest.fixture(scope="module")
def served(kit_image):
    agent = AgentSettings(state_dir=Path(kit_image).parent / f"agent-srv-{id(kit_image)}",
                          image_dirs=[str(Path(kit_image).parent)])
    server = ServerProcess(backend={"name": "local", "settings": {"agent": agent.model_dump(mode="json")}})
    yield server, kit_image
    server.cleanup()
    from orchard.backends.local.launcher import stop_agent

    stop_agent(agent)


@pytest.fixture(scope="module")
def sandbox(served):
    server, image = served
    with server.http() as http:
        created = http.post("/sandboxes", json={"image": image}).json()
        assert created["status"] == "ready", created
        yield created
        http.delete(f"/sandboxes/{created['sandbox_id']}")


def pty(server: ServerProcess, sandbox_id: str, key: str = API_KEY, via: str = "query") -> Frames:
    return Frames(open_socket(server.url, f"/sandboxes/{sandbox_id}/exec/pty", key, via=via))


def test_python_repl_through_the_server(served, sandbox):
    server, _ = served
    term = pty(server, sandbox["sandbox_id"], via="protocol")
    assert term.init(["python3", "-q"])["type"] == "ready"
    python_repl(term, exit_code=5)


def test_read_prompt_ctrl_c_and_exit_codes(served, sandbox):
    server, _ = served
    term = pty(server, sandbox["sandbox_id"], via="header")
    term.init(["bash", "--norc"], env={"PS1": "$ "})
    term.stdin('read -p "who? " who; echo "hi $who"\n')
    term.until_output("who? ")
    term.stdin("relay\n")
    term.until_output("hi relay")
    term.stdin("sh -c 'echo sleep''ing; exec sleep 300'\n")
    term.until_output("sleeping")
    term.stdin("\x03")
    term.stdin("echo after=$?\n")
    term.until_output("after=130")
    term.stdin("exit 42\n")
    assert term.until_end() == {"type": "exit", "code": 42}
    term = pty(server, sandbox["sandbox_id"])
    term.init(["sleep", "300"])
    term.send(type="signal", sig="TERM")
    assert term.until_end() == {"type": "exit", "code": -15}


def test_refusals_through_the_server(served, sandbox):
    server, _ = served
    sid = sandbox["sandbox_id"]
    assert Frames(open_socket(server.url, f"/sandboxes/{sid}/exec/pty", "wrong")).close_code() == 4401
    assert Frames(open_socket(server.url, f"/sandboxes/{sid}/exec/pty")).close_code() == 4401
    assert Frames(open_socket(server.url, "/sandboxes/sbx-nope/exec/pty", API_KEY)).close_code() == 4404
    # the per-sandbox agent token of one sandbox opens no other sandbox's terminal on the agent
    with server.http() as http:
        other = http.post("/sandboxes", json={"image": served[1]}).json()
        try:
            agent_url, token = other["agent_url"], other["agent_token"]
            assert token and agent_url
            refused = Frames(open_socket(agent_url, f"/sandboxes/{sid}/exec/pty", token, via="protocol"))
            assert refused.close_code() == 4401
            own = Frames(open_socket(agent_url, f"/sandboxes/{other['sandbox_id']}/exec/pty", token, via="protocol"))
            assert own.init(["true"])["type"] == "ready" and own.until_end() == {"type": "exit", "code": 0}
        finally:
            http.delete(f"/sandboxes/{other['sandbox_id']}")


def test_a_deleted_sandbox_ends_the_socket_with_error(served):
    server, image = served
    with server.http() as http:
        sid = http.post("/sandboxes", json={"image": image}).json()["sandbox_id"]
        term = pty(server, sid)
        term.init(["bash", "-c", "echo up; sleep 300"])
        term.until_output("up")
        assert http.delete(f"/sandboxes/{sid}").status_code == 200
        frame = term.until_end()
        assert frame["type"] == "error" and sid in frame["message"]
        assert Frames(open_socket(server.url, f"/sandboxes/{sid}/exec/pty", API_KEY)).close_code() in (4404, 4409)
