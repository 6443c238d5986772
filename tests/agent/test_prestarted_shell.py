"""The prestarted bash (``prestart_shell``, spawner.py's ``SHELL_WRAPPER``): a command run by
a bash started ahead of it reads the same as one run by a fresh ``bash -c``, except the one
documented difference (a syntax error says ``eval`` where ``bash -c`` says ``-c``); requests
it cannot run as ``bash -c`` would (their own env, stdin, a login shell) still run right.

Each command runs on two real agents side by side: one with the prestarted shell, one with
``prestart_shell: false`` (every command a fresh ``bash -c`` from the holder's fork).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest


def _client(agent_settings, suffix: str, prestart: bool):
    from orchard.client import Client

    settings = agent_settings.model_copy(update={"state_dir": Path(f"{agent_settings.state_dir}-{suffix}"),
                                                 "spawner": True, "prestart_shell": prestart})
    return settings, Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")})


@pytest.fixture(scope="module")
def pair(agent_settings):
    from orchard.backends.local.launcher import stop_agent

    made = [_client(agent_settings, "prestart", True), _client(agent_settings, "fresh", False)]
    sandboxes = [client.create("host") for _, client in made]
    yield sandboxes
    for handle in sandboxes:
        handle.delete()
    for settings, client in made:
        client.close()
        stop_agent(settings)
        shutil.rmtree(settings.state_dir, ignore_errors=True)


SAME = [
    'echo "$_"', 'echo $0 $# "$@"', "echo $LINENO; echo $LINENO\necho $LINENO", "declare -p OLDPWD PWD",
    "echo $SECONDS", 'echo "$BASH_EXECUTION_STRING"', "set | grep -c '^c='", "exit 7", "nosuchcmd", "echo $-",
    "ls /proc/self/fd", "echo $SHLVL", "return 3", "f() { echo ${FUNCNAME[*]} ${BASH_LINENO[*]}; caller; }; f",
    "echo ${BASH_SOURCE[*]}:x", 'trap "echo bye" EXIT; echo hi', "echo $BASH_COMMAND",
    "env | grep -v '^ORCHARD_JOB=' | sort", "cat /proc/self/status | grep -E '^(Cap|NoNewPrivs|Seccomp)'",
    "ulimit -a", "umask", "trap -p; set -o | grep on", "read x; echo \"[$x]\" $?", "sleep 0.2 & echo started",
    "printf 'a\\0b' | od -c | head -1", "echo é 日本; echo err >&2", "cd /tmp && pwd; cd - >/dev/null; pwd",
    "echo " + "x" * 20000,
]


@pytest.mark.parametrize("command", SAME)
def test_a_command_reads_the_same_as_through_a_fresh_bash(pair, command):
    prestarted, fresh = (handle.exec(command) for handle in pair)
    assert (prestarted.exit_code, prestarted.stdout, prestarted.stderr) == (fresh.exit_code, fresh.stdout, fresh.stderr)


@pytest.mark.parametrize("command", ["echo a; (", "echo a\n(", "shopt -s extglob; echo @(a)"])
def test_the_one_difference_a_syntax_error_names_eval(pair, command):
    prestarted, fresh = (handle.exec(command) for handle in pair)
    assert (prestarted.exit_code, prestarted.stdout) == (fresh.exit_code, fresh.stdout) and fresh.exit_code == 2
    assert prestarted.stderr == fresh.stderr.replace("bash: -c:", "bash: eval:") != fresh.stderr


def test_the_command_runs_in_the_shell_started_ahead(pair):
    """What tells the two apart: the process's command line is the wrapper (``ps`` shows it)."""
    prestarted, fresh = (handle.exec("tr '\\0' ' ' < /proc/$$/cmdline") for handle in pair)
    assert "read -r -u 3" in prestarted.stdout and prestarted.stdout.startswith("bash -c ")
    assert fresh.stdout == "bash -c tr '\\0' ' ' < /proc/$$/cmdline "


def test_cwd_is_entered_at_command_time(pair):
    for handle in pair:
        assert handle.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
        assert handle.exec("mkdir -p /tmp/wd-a && cd /tmp/wd-a && ln -sfn /tmp/wd-a /tmp/wd-link").exit_code == 0
    prestarted, fresh = (handle.exec('pwd; echo "$PWD"', cwd="/tmp/wd-link") for handle in pair)
    assert prestarted.stdout == fresh.stdout == "/tmp/wd-a\n/tmp/wd-a\n"
    # The prepared directory removed and made again while the next shell waits: it enters the new one.
    for handle in pair:
        handle.exec("rm -rf /tmp/wd-b; mkdir /tmp/wd-b")
        assert handle.exec("rm -rf /tmp/wd-b && mkdir /tmp/wd-b && touch /tmp/wd-b/new").exit_code == 0
        assert handle.exec("ls", cwd="/tmp/wd-b").stdout == "new\n"


def test_requests_a_prestarted_shell_cannot_run_still_run_right(pair):
    prestarted, _ = pair
    for _ in range(2):  # each kind after the other: the spawner prepares what the last request needed
        job = prestarted.exec("cat; echo $A", stdin="in\n", env={"A": "b"})
        assert (job.exit_code, job.stdout) == (0, "in\nb\n")
        assert prestarted.exec("echo $PPID").stdout == "1\n"
        job = prestarted.exec("echo $0", login_shell=True)
        assert job.exit_code == 0 and "bash" in job.stdout
        assert prestarted.exec("echo $PPID; echo ok").stdout == "1\nok\n"
        assert prestarted.exec("x=1; echo ok", env={"BASH_ENV": "/nonexistent"}).stdout == "ok\n"


def test_a_timeout_kills_the_command_and_what_it_started(pair):
    prestarted, _ = pair
    started = time.monotonic()
    job = prestarted.exec("sleep 300 & echo $! > /tmp/bg; sleep 300", timeout=1)
    assert job.exit_code == 124 and time.monotonic() - started < 20
    pid = prestarted.exec("cat /tmp/bg").stdout.strip()
    assert prestarted.exec(f"kill -0 {pid} 2>/dev/null && echo alive || echo gone").stdout == "gone\n"


def test_a_sandbox_process_meddling_with_the_waiting_shell_hurts_only_its_own_next_command(pair):
    """The waiting bash runs as the sandbox's user (it is dumpable, like any command): a
    background process of the sandbox can open its descriptors through /proc. It can spoil
    the sandbox's own next command (as it could by killing it); it never reaches the agent,
    another sandbox or the command after next."""
    prestarted, _ = pair
    meddle = ("for p in /proc/[0-9]*; do "
              "  grep -q 'read -r -u 3' $p/cmdline 2>/dev/null || continue; "
              "  [ $p = /proc/$$ ] && continue; "
              "  printf 'echo hijacked\\0' > $p/fd/4 2>/dev/null; echo > $p/fd/3 2>/dev/null; echo \"tried $p\"; "
              "done")
    assert prestarted.exec(f"({meddle}) > /tmp/meddled 2>&1 &").exit_code == 0
    time.sleep(0.5)
    spoiled = prestarted.exec("echo mine")
    assert "tried /proc/" in prestarted.exec("cat /tmp/meddled").stdout  # it did reach a waiting shell
    assert spoiled.stdout in ("mine\n", "", "hijacked\n")  # its own next command, run or spoiled
    for _ in range(3):
        assert prestarted.exec("echo mine").stdout == "mine\n"  # the commands after it are its own again
