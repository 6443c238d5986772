"""The backend conformance suite: what every backend must do, written once.

These tests only use the SDK and the ``host`` image (which must provide a POSIX
shell, coreutils, python3 and git), so a third-party backend proves itself with
``pytest --pyargs orchard.testing.conformance --orchard-backend NAME``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import time

import pytest

from orchard.errors import FileOperationFailed, InvalidRequest, SandboxConflict, SandboxNotFound

# -- life cycle ------------------------------------------------------------------


def test_create_get_list_delete(orchard_client, orchard_image):
    handle = orchard_client.create(orchard_image, labels={"suite": "conformance"})
    assert handle.info.status == "ready" and handle.info.ready
    assert orchard_client.get(handle.id).info.sandbox_id == handle.id
    assert handle.id in {s.sandbox_id for s in orchard_client.list()}
    handle.delete()
    with pytest.raises(SandboxNotFound):
        orchard_client.get(handle.id)
    assert handle.id not in {s.sandbox_id for s in orchard_client.list()}


def test_create_with_same_id_is_idempotent_and_conflicts_on_other_spec(orchard_client, orchard_image):
    sandbox_id = f"conf-{time.time_ns()}"
    with orchard_client.create(orchard_image, sandbox_id=sandbox_id) as first:
        again = orchard_client.create(orchard_image, sandbox_id=sandbox_id)
        assert again.id == first.id
        with pytest.raises(SandboxConflict):
            orchard_client.create(orchard_image, sandbox_id=sandbox_id, block_network=False)


def test_unknown_sandbox_is_a_typed_error(orchard_client):
    with pytest.raises(SandboxNotFound):
        orchard_client.get("no-such-sandbox")
    with pytest.raises(SandboxNotFound):
        orchard_client.delete("no-such-sandbox")


# -- exec ------------------------------------------------------------------------


def test_exec_returns_output_and_exit_code(sandbox):
    job = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (job.stdout, job.stderr, job.exit_code) == ("out\n", "err\n", 3)
    assert job.status == "failed" and job.error_type is None  # ran to completion: no error_type
    ok = sandbox.exec(["printf", "%s|", "a b", "c"])
    assert ok.stdout == "a b|c|" and ok.status == "succeeded"


def test_cwd_env_stdin(sandbox):
    sandbox.exec("mkdir -p sub/dir")
    assert sandbox.exec("pwd", cwd="sub/dir").stdout.strip().endswith("/sub/dir")
    assert sandbox.exec("echo $GREETING", env={"GREETING": "hello"}).stdout == "hello\n"
    assert sandbox.exec("tr a-z A-Z", stdin="shout\n").stdout == "SHOUT\n"


def test_commands_do_not_inherit_the_agent_environment(sandbox):
    out = sandbox.exec("env").stdout
    for name in ("PYTHONHOME", "PYTHONPATH", "LD_LIBRARY_PATH", "ORCHARD_AGENT_TOKEN"):
        assert f"{name}=" not in out


def test_nonexistent_cwd_is_rejected(sandbox):
    with pytest.raises(InvalidRequest, match="cwd"):
        sandbox.exec("true", cwd="/definitely/not/here")


def test_invalid_exec_bodies_are_rejected(sandbox):
    with pytest.raises(InvalidRequest, match="timeout_seconds"):
        sandbox.exec("true", timeout=-1)
    with pytest.raises(InvalidRequest, match="command"):
        sandbox.exec("x" * (2 << 20))
    assert sandbox.exec("echo still fine").stdout == "still fine\n"


# Whether a killed process is gone: no /proc entry, or a zombie its reaper has yet to collect
# (``kill -0`` succeeds on a zombie); a SIGKILLed process on a loaded machine may take a
# moment to run its exit, so this waits up to 10 s before it says "alive".
GONE = ("p=$(cat {pid_file}); for i in $(seq 100); do s=$(cut -d' ' -f3 /proc/$p/stat 2>/dev/null); "
        "if [ -z \"$s\" ] || [ \"$s\" = Z ]; then echo dead; exit 0; fi; sleep 0.1; done; echo alive")


def test_timeout_kills_the_process_tree(sandbox):
    start = time.monotonic()
    job = sandbox.exec("sleep 300 & echo $! > bg.pid; sleep 300", timeout=1)
    assert time.monotonic() - start < 10
    assert job.exit_code == 124 and job.error_type == "timeout" and job.status == "failed"
    assert "timed out" in job.stderr
    assert sandbox.exec(GONE.format(pid_file="bg.pid")).stdout == "dead\n"


def test_timeout_also_kills_what_left_the_session(sandbox):
    job = sandbox.exec("setsid sleep 300 & echo $! > escaped.pid; sleep 300", timeout=1)
    assert job.exit_code == 124
    assert sandbox.exec(GONE.format(pid_file="escaped.pid")).stdout == "dead\n"


def test_idle_timeout(sandbox):
    job = sandbox.exec("echo started; sleep 300", idle_timeout=1, timeout=60)
    assert job.exit_code == 124 and job.error_type == "timeout" and "no output" in job.stderr
    assert job.stdout == "started\n"


def test_background_process_does_not_hang_and_survives(sandbox):
    start = time.monotonic()
    job = sandbox.exec("sleep 1000 & echo $! > sleeper.pid; echo launched")
    assert job.stdout == "launched\n" and time.monotonic() - start < 5
    assert sandbox.exec("kill -0 $(cat sleeper.pid) && echo alive").stdout == "alive\n"
    assert sandbox.exec("kill $(cat sleeper.pid); sleep 0.2; kill -0 $(cat sleeper.pid) 2>/dev/null || echo gone").stdout == "gone\n"


def test_background_server_is_reachable_from_the_next_command(sandbox):
    sandbox.upload("www/index.html", "served from the sandbox\n")
    sandbox.exec("cd www && nohup python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 & echo $! > server.pid")
    fetch = ("python3 -c \"import time,urllib.request\n"
             "for _ in range(100):\n"
             "    try:\n"
             "        print(urllib.request.urlopen('http://127.0.0.1:8765/').read().decode(), end=''); break\n"
             "    except OSError: time.sleep(0.1)\"")
    assert sandbox.exec(fetch, timeout=30).stdout == "served from the sandbox\n"
    assert sandbox.exec("kill $(cat server.pid) && echo killed").stdout == "killed\n"


def test_output_is_capped_keeping_head_and_tail(sandbox):
    job = sandbox.exec("echo HEAD; head -c 20000000 /dev/zero | tr '\\0' x; echo; echo TAIL")
    assert job.truncated and job.exit_code == 0
    assert job.stdout.startswith("HEAD\n") and job.stdout.endswith("TAIL\n")
    assert job.stdout_bytes > 20_000_000 and len(job.stdout) < 4_000_000
    assert "truncated" in job.stdout


def test_binary_output_is_safe(sandbox):
    job = sandbox.exec("head -c 100000 /dev/urandom; printf '\\377\\376\\0end'")
    assert job.exit_code == 0 and job.stdout.endswith("end")
    assert sandbox.exec("echo ok").stdout == "ok\n"


def test_commands_in_one_sandbox_are_serialized(sandbox):
    command = "echo start >> log; sleep 0.3; echo end >> log"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: sandbox.exec(command), range(4)))
    assert sandbox.exec("cat log").stdout == "start\nend\n" * 4


def test_separate_sandboxes_run_in_parallel(orchard_client, orchard_image):
    with orchard_client.create(orchard_image) as a, orchard_client.create(orchard_image) as b:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            jobs = list(pool.map(lambda s: s.exec("sleep 1.5; echo done"), [a, b]))
        assert [j.stdout for j in jobs] == ["done\n", "done\n"]
        assert time.monotonic() - start < 2.8


def test_submit_then_wait_job(sandbox):
    job_id = sandbox.submit("sleep 1; echo finished")
    early = sandbox.wait_job(job_id, timeout=0.1)
    assert early.status in ("queued", "running")
    assert sandbox.wait_job(job_id, timeout=30).stdout == "finished\n"
    assert sandbox.job(job_id).status == "succeeded"


def test_same_idempotency_key_runs_once(sandbox):
    first = sandbox.exec("echo ran >> runs; echo once", job_id="idem-1")
    second = sandbox.exec("echo ran >> runs; echo once", job_id="idem-1")
    assert first.job_id == second.job_id == "idem-1"
    assert sandbox.exec("cat runs").stdout == "ran\n"
    with pytest.raises(SandboxConflict):
        sandbox.exec("echo something else", job_id="idem-1")


def test_login_shell_sources_bashrc_without_tty_noise(sandbox):
    sandbox.exec("echo 'export FROM_BASHRC=conda-like' >> ~/.bashrc")
    job = sandbox.exec("echo $FROM_BASHRC", login_shell=True)
    assert job.stdout == "conda-like\n"
    assert "job control" not in job.stderr and "terminal process group" not in job.stderr
    assert sandbox.exec("echo ${FROM_BASHRC:-unset}").stdout == "unset\n"


def test_streaming_exec_delivers_output_as_it_comes(sandbox):
    start = time.monotonic()
    arrivals = []
    events = []
    for event in sandbox.exec_stream("for i in 1 2 3; do echo line$i; sleep 0.4; done; echo bye >&2"):
        arrivals.append(time.monotonic() - start)
        events.append(event)
    assert events[-1]["type"] == "exit" and events[-1]["job"]["exit_code"] == 0
    stdout = "".join(e["data"] for e in events if e["type"] == "stdout")
    assert stdout == "line1\nline2\nline3\n"
    assert "".join(e["data"] for e in events if e["type"] == "stderr") == "bye\n"
    assert arrivals[0] < 0.8 < arrivals[-1]  # the first line came before the command ended


# -- files -----------------------------------------------------------------------


def test_upload_download_list(sandbox):
    payload = bytes(range(256)) * 100
    assert sandbox.upload("data/blob.bin", payload) == len(payload)
    assert sandbox.download("data/blob.bin") == payload
    assert sandbox.exec("wc -c < data/blob.bin").stdout.strip() == str(len(payload))
    names = {(f.name, f.type) for f in sandbox.list_files("data")}
    assert names == {("blob.bin", "file")}
    sandbox.exec("mkdir data/sub")
    assert ("sub", "directory") in {(f.name, f.type) for f in sandbox.list_files("data")}
    sandbox.upload("tool.sh", "#!/bin/sh\necho tool\n", mode=0o755)
    assert sandbox.exec("./tool.sh").stdout == "tool\n"


def test_large_files_round_trip(sandbox):
    payload = os.urandom(24 << 20)
    assert sandbox.upload("big/blob", payload) == len(payload)
    assert sandbox.exec("sha256sum big/blob").stdout.split()[0] == hashlib.sha256(payload).hexdigest()
    assert sandbox.download("big/blob") == payload


def test_files_written_by_commands_can_be_downloaded(sandbox):
    sandbox.exec("echo made-inside > inside.txt")
    assert sandbox.download("inside.txt") == b"made-inside\n"


def test_file_errors_are_typed(sandbox):
    with pytest.raises(FileOperationFailed, match="no such file"):
        sandbox.download("missing.txt")
    with pytest.raises(FileOperationFailed):
        sandbox.download("/")
    with pytest.raises(FileOperationFailed):
        sandbox.list_files("missing-dir")


def test_symlinks_and_dotdot_stay_inside_the_sandbox(sandbox):
    sandbox.exec("ln -s / rootlink; ln -s ../../../../../../etc etclink; ln -s /etc/passwd pw")
    inside = sandbox.exec("cat /etc/passwd").stdout.encode()
    assert sandbox.download("pw") == inside
    assert sandbox.download("etclink/passwd") == inside
    assert sandbox.download("../../../../../../etc/passwd") == inside
    assert sandbox.download("rootlink/etc/passwd") == inside


def test_apply_patch(sandbox):
    sandbox.exec("git init -q repo && printf 'a\\nb\\n' > repo/f.txt")
    patch = "--- a/f.txt\n+++ b/f.txt\n@@ -1,2 +1,2 @@\n a\n-b\n+c\n"
    sandbox.upload("repo/.keep", "")
    result = sandbox.apply_patch(patch.replace("a/f.txt", "a/repo/f.txt").replace("b/f.txt", "b/repo/f.txt"))
    assert result.success, result.stderr
    assert sandbox.exec("cat repo/f.txt").stdout == "a\nc\n"
    bad = sandbox.apply_patch("--- a/nope\n+++ b/nope\n@@ -1 +1 @@\n-x\n+y\n")
    assert not bad.success and bad.exit_code != 0


def test_upload_rejects_bad_base64(sandbox):
    with pytest.raises(InvalidRequest):
        sandbox._portal.call(sandbox._inner.api.request(
            "POST", f"/sandboxes/{sandbox.id}/files", json_body={"path": "x", "content": "%%%not-base64"}))
    with pytest.raises(FileOperationFailed):  # and nothing was written
        sandbox.download("x")


# -- hostile input (orchard/testing/hostile.py) ------------------------------------

from orchard.testing.hostile import *  # noqa: E402,F401,F403
from orchard.testing.isolation import *  # noqa: E402,F401,F403
from orchard.testing.snapshots import *  # noqa: E402,F401,F403
