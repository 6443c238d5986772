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
    "echo " + "x" * 20000, "readlink /proc/self/fd/1 /proc/self/fd/2",
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
    background process of the sandbox can open some of its descriptors through /proc (its
    command memfd; the pipe it waits on is the agent's, mode 0600). The agent overwrites the
    command at hand-over, so at most a write racing that moment spoils that one command (as
    killing it would); it never reaches the agent or another sandbox."""
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


HIJACK = r"""
for try in $(seq 100); do
  for p in /proc/[0-9]*; do
    grep -q 'read -r -u 3' $p/cmdline 2>/dev/null && [ $p != /proc/$$ ] && break 2
  done
  sleep 0.05
done
gdb -q -p ${p#/proc/} -batch -ex 'call (int)system("setsid bash -c \"exec -a MARKER sleep 1000\" </dev/null >/dev/null 2>&1 &")' >/tmp/gdb.out 2>&1
echo "injected into ${p#/proc/}"
sleep 300
"""


def test_a_killed_job_cannot_live_on_in_the_next_commands_waiting_shell(pair):
    """Found in review: the waiting bash is dumpable (as any command is), so a job's process
    can ptrace it (gdb here) and fork from it into the next job's group, out of reach of its
    own job's kill; before the fix the fork outlived the job's timeout. A killed job now takes
    the waiting process and everything in its group with it."""
    import secrets
    import subprocess

    prestarted, _ = pair
    marker = f"orchard-hijacked-{secrets.token_hex(4)}"
    job = prestarted.exec(HIJACK.replace("MARKER", marker), timeout=20)  # room for gdb on a loaded machine
    assert job.exit_code == 124 and "injected into" in job.stdout, job
    assert "$1 = 0" in prestarted.exec("cat /tmp/gdb.out").stdout  # system() ran in the waiting shell
    deadline = time.monotonic() + 5
    while subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the fork from the waiting shell outlived the job's kill"
        time.sleep(0.05)
    assert prestarted.exec("echo mine").stdout == "mine\n"  # the next command runs in a shell of its own


PREFILL = r"""
import os, time
done, deadline = set(), time.time() + 60
while time.time() < deadline:
    for name in os.listdir("/proc"):
        try:
            if name in done or not name.isdigit() or not os.path.lexists(f"/proc/{name}/fd/3"):
                continue  # fd 3: the pipe a shell waits on (closed once it has its command)
            if b"read -r -u 3" not in open(f"/proc/{name}/cmdline", "rb").read():
                continue
            for fd in (1, 2):
                with open(f"/proc/{name}/fd/{fd}", "w") as out:
                    out.write("ALL TESTS PASSED\n")
            done.add(name)
            with open("/tmp/prefilled", "a") as log:
                log.write(name + "\n")
        except OSError:
            pass
    time.sleep(0.005)
"""


def test_output_written_into_a_waiting_shell_before_its_command_is_not_that_command_s(pair):
    """Found in review: a background process wrote "ALL TESTS PASSED" into each waiting
    shell's stdout memfd (it can reopen it through /proc: a command's own `> /dev/stdout`
    needs that) and every later command carried it. The agent empties both files at hand-over.
    (Writing into a command's output while it runs is open to any process of the sandbox,
    with or without a prestarted shell: that is the sandbox's own command.)"""
    prestarted, _ = pair

    def prefilled() -> int:
        try:
            return len(prestarted.download("/tmp/prefilled").split())
        except Exception:  # not there yet
            return 0

    def wait_until_prefilled(count: int) -> None:
        deadline = time.monotonic() + 20
        while prefilled() < count:
            assert time.monotonic() < deadline, "the waiting shell was never written to"
            time.sleep(0.02)

    prestarted.upload("/tmp/prefill.py", PREFILL)
    assert prestarted.exec("rm -f /tmp/prefilled; python3 /tmp/prefill.py >/dev/null 2>&1 &").exit_code == 0
    for n in range(1, 6):
        wait_until_prefilled(n)  # the shell that will run the next command holds the fake output now
        job = prestarted.exec("echo mine; echo err >&2")
        assert (job.exit_code, job.stdout, job.stderr) == (0, "mine\n", "err\n"), job
    assert prestarted.exec("echo ok > /dev/stdout").stdout == "ok\n"  # reopening its own output still works
    prestarted.exec("pkill -f prefill.py")


@pytest.mark.parametrize("env", [{"SHELLOPTS": "errexit"}, {"SHELLOPTS": "xtrace"}, {"BASH_ENV": "/tmp/rc"},
                                 {"BASH_FUNC_read%%": "() { echo hijacked; }"}])
def test_a_sandbox_whose_env_changes_how_bash_starts_runs_each_command_fresh(agent_settings, env):
    """Found in review: the sandbox's own SHELLOPTS=errexit made the wrapper exit on its
    first read (every command: exit 1, no output), xtrace traced it into every job's stderr,
    and a BASH_ENV file was read before the previous command had written it."""
    from orchard.agent.spawner import prestartable
    from orchard.backends.local.launcher import stop_agent

    assert not prestartable(env) and prestartable({"PATH": "/bin", "LANG": "C.UTF-8"})
    settings, client = _client(agent_settings, "env", True)
    handle = client.create("host", env=env)
    try:
        handle.exec("echo 'STAGE=old' > /tmp/rc")
        handle.exec("sleep 0.3; echo 'STAGE=new' > /tmp/rc")
        job = handle.exec("echo run; echo stage=$STAGE; tr '\\0' ' ' < /proc/$$/cmdline")
        assert job.exit_code == 0 and job.stdout.startswith("run\n"), job
        assert "read -r -u 3" not in job.stdout  # a fresh bash -c
        if "BASH_ENV" in env:
            assert "stage=new" in job.stdout
    finally:
        handle.delete()
        client.close()
        stop_agent(settings)
        shutil.rmtree(settings.state_dir, ignore_errors=True)


def test_an_agent_out_of_descriptors_runs_commands_the_plain_way_and_recovers(agent_settings):
    """A prestarted bash takes six descriptors the plain way does not; an agent that cannot
    make them (EMFILE) runs the command without one (or answers with a typed error where
    even that has no room), and prestarts again once it can. Made real: the agent's
    descriptor limit lowered with prlimit, step by step, to below what it holds plus what a
    prestarted bash needs."""
    import json
    import os
    import resource

    from orchard.backends.local.launcher import stop_agent
    from orchard.errors import OrchardError

    settings, client = _client(agent_settings, "emfile", True)
    try:
        handle = client.create("host")
        probe = "tr '\\0' ' ' < /proc/$$/cmdline"
        assert "read -r -u 3" in handle.exec(probe).stdout
        pid = json.loads((settings.agent_dir / "agent.json").read_text())["pid"]
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        held = len(os.listdir(f"/proc/{pid}/fd"))
        ways = []
        try:
            for room in range(0, 16):
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (held + room, hard))
                try:
                    result = handle.exec(probe, timeout=20)
                except OrchardError as exc:  # no room even for the plain way: a typed answer, not a hang
                    ways.append(("refused", type(exc).__name__))
                    continue
                assert result.exit_code == 0, (room, result)
                ways.append(("prestarted" if "read -r -u 3" in result.stdout else "plain", room))
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert ("plain" in {way for way, _ in ways}), ways  # some room for a command, none for a shell ahead
        assert ways[-1][0] == "prestarted", ways
        for _ in range(3):  # room again: the next commands run in a bash started ahead, as before
            assert handle.exec("echo ok").stdout == "ok\n"
        assert "read -r -u 3" in handle.exec(probe).stdout
        handle.delete()
        assert len(os.listdir(f"/proc/{pid}/fd")) <= held + 2  # nothing it made on the way is still open
    finally:
        client.close()
        stop_agent(settings)
        shutil.rmtree(settings.state_dir, ignore_errors=True)
