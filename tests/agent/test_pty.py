"""``WS /sandboxes/{id}/exec/pty`` straight to the agent, with a plain WebSocket client and
exactly the original's frames: real processes on real terminals in real sandboxes."""

from __future__ import annotations

from tests.pty_frames import Frames, open_socket, python_repl


def pty(pty_agent, sandbox_id: str, via: str = "query") -> Frames:
    url, key, _ = pty_agent
    return Frames(open_socket(url, f"/sandboxes/{sandbox_id}/exec/pty", key, via=via))


def test_python_repl(pty_agent, pty_sandbox):
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    ready = term.init(["python3", "-q"], rows=30, cols=100)
    assert ready["type"] == "ready" and ready["pid"] > 0
    term.stdin("import os, shutil; print(os.getuid(), shutil.get_terminal_size())\n")
    term.until_output("1000 os.terminal_size(columns=100, lines=30)")
    python_repl(term, exit_code=3)


def test_read_with_a_prompt_and_the_key_in_each_place(pty_agent, pty_sandbox):
    for via in ("query", "protocol", "header"):
        term = pty(pty_agent, pty_sandbox["sandbox_id"], via=via)
        assert term.init(["bash", "-c", 'read -p "name? " n; echo "hello $n"; exit 7'])["type"] == "ready"
        term.until_output("name? ")
        term.stdin("orchard\n")
        term.until_output("hello orchard")
        assert term.until_end() == {"type": "exit", "code": 7}


def test_ctrl_c_and_signals(pty_agent, pty_sandbox):
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    term.init(["bash", "--norc"], env={"PS1": "$ "})
    # "sleep""ing" in the echoed input is not "sleeping": the output waits for the command
    # (Ctrl-C makes an interactive bash drop the rest of the line: $? is asked on the next one)
    term.stdin("sh -c 'echo sleep''ing; exec sleep 300'\n")
    term.until_output("sleeping")
    term.stdin("\x03")  # the terminal's own Ctrl-C reaches the foreground sleep
    term.stdin("echo after=$?\n")
    term.until_output("after=130")
    term.stdin("sh -c 'echo nap''ping; exec sleep 300'\n")
    term.until_output("napping")
    term.send(type="signal", sig="INT")  # the wire's signal frame does the same
    term.stdin("echo again=$?\n")
    term.until_output("again=130")
    term.send(type="signal", sig="KILL")
    assert term.until_end() == {"type": "exit", "code": -9}


def test_close_frame_ends_the_process(pty_agent, pty_sandbox):
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    term.init(["sleep", "300"])
    term.send(type="close")
    assert term.until_end()["type"] == "exit"


def test_runs_inside_the_sandbox_like_a_command(pty_agent, pty_sandbox):
    """Same uid, no capabilities, the sandbox's own terminal (not a host /dev/pts)."""
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    term.init(["bash", "-c", "id -u; grep CapEff /proc/self/status; readlink /proc/self/fd/0; "
                             "grep Seccomp: /proc/self/status; echo done"])
    out = term.until_output("done").decode()
    assert "1000" in out and "0000000000000000" in out and "Seccomp:\t2" in out
    assert "/dev/pts/0" in out  # the first terminal of the sandbox's own devpts instance
    assert term.until_end() == {"type": "exit", "code": 0}


def test_bad_frames_get_a_clear_error(pty_agent, pty_sandbox):
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    term.send(type="stdin", data="aGk=")
    frame = term.until_end()
    assert frame["type"] == "error" and "init" in frame["message"]
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    term.send(type="init", cmd=["true"], rows=-1)
    frame = term.until_end()
    assert frame["type"] == "error" and "rows" in frame["message"]
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    term.init(["cat"])
    term.send(type="signal", sig="USR1")
    frame = term.until_end()
    assert frame["type"] == "error" and "sig" in frame["message"]
    term = pty(pty_agent, pty_sandbox["sandbox_id"])
    frame = term.init(["no-such-program-here"])
    assert frame["type"] in ("ready", "error")
    assert term.until_end() if frame["type"] == "ready" else True


def test_refusals_use_the_original_close_codes(pty_agent, pty_sandbox):
    url, key, http = pty_agent
    sid = pty_sandbox["sandbox_id"]
    assert Frames(open_socket(url, f"/sandboxes/{sid}/exec/pty", "wrong")).close_code() == 4401
    assert Frames(open_socket(url, f"/sandboxes/{sid}/exec/pty")).close_code() == 4401
    assert Frames(open_socket(url, "/sandboxes/sbx-nope/exec/pty", key)).close_code() == 4404


def test_a_killed_sandbox_ends_the_socket_with_error(pty_agent, kit_image):
    _, _, http = pty_agent
    sid = http.post("/sandboxes", json={"image": kit_image}).json()["sandbox_id"]
    term = pty(pty_agent, sid)
    term.init(["bash", "-c", "echo started; sleep 300"])
    term.until_output("started")
    assert http.delete(f"/sandboxes/{sid}").status_code == 200
    frame = term.until_end()
    assert frame["type"] == "error" and sid in frame["message"]
