"""The SDK's interactive processes and shell sessions, in process (straight to the agent),
sync and async: real sandboxes, real terminals."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from orchard.client.session import SessionDied


@pytest.fixture(scope="module")
def sandbox(orchard_client, kit_image):
    with orchard_client.create(kit_image) as sandbox:
        yield sandbox


def test_pty_handle(sandbox):
    with sandbox.exec(["python3", "-q"], pty=True) as proc:
        assert proc.pid > 0
        proc.write_stdin("print(2 ** 10)\n")
        seen = b""
        while b"1024" not in seen:
            chunk = proc.read(timeout=20)
            assert chunk, f"no output: {seen!r}"
            seen += chunk
        proc.resize(30, 100)
        proc.write_stdin("exit(4)\n")
        assert proc.wait(timeout=20) == 4
    with sandbox.pty(["sleep", "300"]) as proc:
        assert proc.read(timeout=0.2) == b""  # nothing yet, and nothing lost
        proc.kill("TERM")
        assert proc.wait(timeout=20) == -15
    with sandbox.exec("echo from-shell; exit 3", pty=True) as proc:
        assert b"from-shell" in proc.read_all(timeout=20) and proc.exit_code == 3


def test_session_state_persists_and_markers_cannot_fool_it(sandbox):
    with sandbox.session() as session:
        assert session.run("cd /tmp && export FOO=bar && f() { echo \"f:$1\"; }").exit_code == 0
        result = session.run("pwd; echo $FOO; f x")
        assert result.output == "/tmp\nbar\nf:x\n" and result.exit_code == 0
        fake = session.run("printf '\\n__ORCHARD_%s_%s__\\n' 0123456789abcdef01234567 0; echo after; exit_code() { :; }; false")
        assert "after" in fake.output and fake.exit_code == 1
        assert session.run("echo 'it''s'; printf 'no newline'").output == "its\nno newline"
        long = "x" * 10000
        assert session.run(f"echo {long} | wc -c").output.strip() == "10001"


def test_session_timeout_keeps_it_usable_and_a_dead_one_says_so(sandbox):
    with sandbox.session() as session:
        result = session.run("echo start; sleep 300", timeout=1)
        assert result.timed_out and result.exit_code == 124 and "start" in result.output
        assert session.run("echo next").output == "next\n"
        assert session.run("trap '' INT; sleep 300", timeout=1).timed_out  # TERM ends it
        assert session.run("echo again").output == "again\n"
        with pytest.raises(SessionDied):
            session.run("exit 0")


def _agent_pid() -> int:
    from tests.conftest import TEST_STATE_DIR

    return json.loads((TEST_STATE_DIR / "agent" / "agent.json").read_text())["pid"]


def _rss_kib(pid: int) -> int:
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:")).split()[1])


def test_thousand_commands_without_a_leak(sandbox):
    agent = _agent_pid()
    with sandbox.session() as session:
        for i in range(50):
            session.run("true")  # warm up
        ours, theirs, rss = len(os.listdir(f"/proc/{os.getpid()}/fd")), len(os.listdir(f"/proc/{agent}/fd")), _rss_kib(agent)
        for i in range(1000):
            assert session.run(f"echo {i}").output == f"{i}\n"
        assert len(os.listdir(f"/proc/{os.getpid()}/fd")) - ours <= 2
        assert len(os.listdir(f"/proc/{agent}/fd")) - theirs <= 2
        assert _rss_kib(agent) - rss < 8 * 1024, "the agent grew by more than 8 MiB over 1,000 commands"
        agent_count = session.run("ls /proc | grep -c '^[0-9]'").output  # processes inside the sandbox
        assert int(agent_count) < 10


def test_async_pty_and_session(orchard_client, kit_image):
    from orchard.client import AsyncClient

    async def main() -> None:
        async with AsyncClient() as client:
            sandbox = await client.create(kit_image)
            async with sandbox:
                async with await sandbox.pty(["bash", "-c", "read x; echo got-$x"]) as proc:
                    await proc.write_stdin("it\n")
                    assert b"got-it" in await proc.read_all(timeout=20)
                    assert proc.exit_code == 0
                async with await sandbox.session() as session:
                    await session.run("cd /")
                    assert (await session.run("pwd")).output == "/\n"

    asyncio.run(main())
