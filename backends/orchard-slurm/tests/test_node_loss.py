"""A pilot's node is lost under a real ``orchard serve`` on the dev cluster (slurm/dev-cluster.sh).

What a node loss is, and what a single machine can show of it: on a cluster the node's
power or kernel goes; every process on it (slurmd, the job's slurmstepd, the pilot's
agent, its sandboxes) vanishes at once with no cleanup, and slurmctld, hearing nothing from
slurmd for ``SlurmdTimeout`` (300 s by default), marks the node DOWN and ends its jobs
``NODE_FAIL`` (or requeues them; pilots are submitted ``--no-requeue``). Here the machine
is also the controller, so the test SIGKILLs slurmd, the job's slurmstepd and every process
in the job's cgroups (nothing gets a signal it could clean up on), then stands in for the
controller's timeout with ``scontrol update state=down`` (the same DOWN node and
``NODE_FAIL`` job that the timeout gives, without waiting 300 s). It cannot show a network
partition (a node alive but unreachable, whose processes go on running), the controller's
own timeout path, or a second node staying healthy: the dev cluster has one node, so every
job on it dies, other services' jobs included (run this test when no one else uses the
dev cluster). Afterwards slurmd is started again and the node returns to idle
(``ReturnToService=2``; ``scontrol update state=resume`` if not), in a ``finally``.

Asserted: the sandboxes on the lost pilot read ``lost`` with a reason naming the Slurm job,
``NODE_FAIL``, the node and why Slurm holds it down, never a 500 on the way; calls on them
answer 410 ``SandboxLost``; what was acknowledged before (a finished job's result, a
delete) stays as it was; once the node is back a new sandbox starts on a new pilot and
runs commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx
import yaml

from orchard.bench.measure import await_processes, count_processes
from slurm_testing import slurm_settings, squeue_jobs
from test_slurm_serve import start_server
from tests.images import free_port  # importable once slurm_testing put the repository on sys.path

SLURM_DIR = Path(os.environ.get("ORCHARD_SLURM_DIR", "/tmp/orchard-slurm"))  # slurm/dev-cluster.sh's
REASON = "orchard test: node lost"


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds:g}s waiting for {what}"
        time.sleep(0.2)


def job_processes(job_id: str) -> list[int]:
    """Every process of a Slurm job on this node: its slurmstepd and what runs in its cgroups."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroups = (entry / "cgroup").read_text()
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue  # it ended meanwhile
        if f"/job_{job_id}/" in cgroups or title.startswith(f"slurmstepd: [{job_id}."):
            found.append(int(entry.name))
    return found


def slurmd_pids() -> list[int]:
    """Live slurmd processes (a SIGKILLed one may linger as a zombie until its parent reaps it)."""
    out = subprocess.run(["pgrep", "-x", "slurmd"], capture_output=True, text=True).stdout
    live = []
    for pid in out.split():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            live.append(int(pid))
    return live


def node_state(node: str) -> str:
    """sinfo's state: "idle", "down*", ... (a trailing * means slurmd is not responding)."""
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def lose_node(node: str, job_id: str) -> None:
    """The node dies: slurmd and the job's processes are SIGKILLed (no cleanup), then the
    controller is told the node is DOWN, as its SlurmdTimeout would after 300 s."""
    for pid in slurmd_pids():
        os.kill(pid, signal.SIGKILL)
    for _ in range(50):  # again until nothing is left: a process may fork while the others die
        victims = job_processes(job_id)
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    assert job_processes(job_id) == [], "the job's processes outlived the node"
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", f"reason={REASON}"], check=True)


def restore_node(node: str) -> None:
    """slurmd started again as dev-cluster.sh starts it; the node back to idle."""
    if not slurmd_pids():
        log = open(SLURM_DIR / "log" / "slurmd.out", "ab")
        subprocess.Popen(["slurmd", "-D", "-N", node], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                         start_new_session=True)  # outlives the test, like the rest of the dev cluster
    deadline = time.monotonic() + 30
    while node_state(node) not in ("idle", "mixed", "allocated"):
        if time.monotonic() > deadline - 20:  # ReturnToService=2 did not bring it back by itself
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        assert time.monotonic() < deadline, f"node {node} stays {node_state(node)!r}"
        time.sleep(0.5)


def remove_job_cgroups(job_id: str) -> list[Path]:
    """Remove the cgroups Slurm made for a job whose slurmstepd was SIGKILLed: nothing is left
    to remove them (a restarted slurmd does not), and each dead one lingers in the kernel (a
    session counted about 950 from such runs). Returns those still there."""
    left = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        for job_dir in hierarchy.glob(f"slurm*/uid_*/job_{job_id}"):
            for directory in sorted((d for d in job_dir.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
                try:
                    directory.rmdir()
                except OSError:
                    pass
            try:
                job_dir.rmdir()
            except OSError:
                left.append(job_dir)
    return left


def test_a_lost_node_reports_its_pilots_sandboxes_lost_and_the_pool_recovers(slurm_cluster):
    settings = slurm_settings(sandboxes_per_pilot=4, max_pilots=2, pilot_idle_seconds=0)
    root = Path(settings["shared_dir"])
    port = free_port()
    config = {"port": port, "api_key": "k", "state": str(root / "server.db"), "log_level": "info",
              "backend": {"name": "slurm", "settings": settings}, "reconciler": {"interval": 1.0, "lost_grace": 1.0}}
    (root / "orchard.yaml").write_text(yaml.safe_dump(config))
    server = start_server(root / "orchard.yaml", port, root / "server.log")
    statuses: list[int] = []  # every answer the server gave during the loss
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"X-API-Key": "k"}, timeout=180) as http:
            def call(method: str, path: str, **kwargs) -> httpx.Response:
                answer = http.request(method, path, **kwargs)
                statuses.append(answer.status_code)
                return answer

            victims = []
            for index in range(2):
                answer = call("POST", "/sandboxes", json={"sandbox_id": f"node-loss-{index}"})
                assert answer.status_code == 200 and answer.json()["status"] == "ready", answer.text
                victims.append(answer.json()["sandbox_id"])
            done = call("POST", f"/sandboxes/{victims[0]}/exec",
                        json={"command": "echo kept; sleep 4243 &", "wait": True, "job_id": "job-before-loss"})
            assert done.status_code == 200 and done.json()["stdout"] == "kept\n", done.text
            assert await_processes("sleep 4243", 1) == 1
            deleted = call("POST", "/sandboxes", json={"sandbox_id": "node-loss-deleted"}).json()["sandbox_id"]
            assert call("DELETE", f"/sandboxes/{deleted}").status_code in (200, 204)
            jobs = call("GET", "/resources").json()["capacity"]["pilot_jobs"]
            assert len(jobs) == 1, jobs  # both sandboxes on one pilot
            job_id = next(iter(jobs.values()))["job_id"]
            node = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True,
                                  text=True).stdout.strip()
            assert node, f"pilot job {job_id} runs on no node"

            lose_node(node, job_id)
            try:
                assert count_processes("sleep 4243") == 0  # the sandboxes died with the node
                # a call on a sandbox finds its agent gone and asks Slurm; the reconciler, listing,
                # finds the other; while Slurm still says RUNNING the answer is a retryable 503
                def lost_with_reason(sandbox_id: str, probe: str) -> bool:
                    if probe == "exec":
                        answer = call("POST", f"/sandboxes/{sandbox_id}/exec", json={"command": "true", "wait": True})
                        if answer.status_code == 503:
                            assert answer.json()["error"]["type"] == "AgentUnreachable", answer.text
                            return False
                        assert answer.status_code == 410, answer.text
                    answer = call("GET", f"/sandboxes/{sandbox_id}")
                    assert answer.status_code == 200, answer.text
                    return answer.json()["status"] == "lost"

                wait_for(lambda: lost_with_reason(victims[0], "exec"), 30, "a call to find its sandbox lost")
                wait_for(lambda: lost_with_reason(victims[1], "get"), 30, "the reconciler to mark the other lost")
                assert [line for line in squeue_jobs(settings["job_name"]) if line.split()[0] == job_id] == []
                for sandbox_id in victims:
                    sandbox = call("GET", f"/sandboxes/{sandbox_id}").json()
                    assert sandbox["status"] == "lost" and not sandbox["ready"], sandbox
                    assert f"Slurm job {job_id}" in sandbox["status_message"], sandbox
                    assert "NODE_FAIL" in sandbox["status_message"], sandbox
                    # which node, and why (its state when the backend asked is a race: it may be back by then)
                    assert f"node {node}, " in sandbox["status_message"], sandbox
                    assert REASON in sandbox["status_message"], sandbox
                    refused = call("POST", f"/sandboxes/{sandbox_id}/exec", json={"command": "true", "wait": True})
                    assert refused.status_code == 410, refused.text
                    error = refused.json()["error"]
                    assert error["type"] == "SandboxLost" and "NODE_FAIL" in error["message"], error
                    files = call("GET", f"/sandboxes/{sandbox_id}/files/list", params={"path": "/"})
                    assert files.status_code == 410 and files.json()["error"]["type"] == "SandboxLost", files.text
            finally:
                restore_node(node)
            assert remove_job_cgroups(job_id) == []  # nothing of the dead job holds them

            # what was acknowledged before the loss is as it was
            kept = call("GET", "/jobs/job-before-loss").json()
            assert kept["status"] == "succeeded" and kept["stdout"] == "kept\n", kept
            assert call("GET", f"/sandboxes/{deleted}").status_code == 404
            # the node is back: a new sandbox, on a new pilot, runs commands
            fresh = call("POST", "/sandboxes", json={"sandbox_id": "node-loss-after"})
            assert fresh.status_code == 200 and fresh.json()["status"] == "ready", fresh.text
            run = call("POST", "/sandboxes/node-loss-after/exec", json={"command": "echo back", "wait": True})
            assert run.status_code == 200 and run.json()["stdout"] == "back\n", run.text
            jobs = call("GET", "/resources").json()["capacity"]["pilot_jobs"]
            assert job_id not in {job["job_id"] for job in jobs.values()}, jobs
            for sandbox_id in [*victims, "node-loss-after"]:
                assert call("DELETE", f"/sandboxes/{sandbox_id}").status_code in (200, 204)
            assert call("GET", "/sandboxes").json()["sandboxes"] == []
        assert all(status < 500 or status == 503 for status in statuses), sorted(set(statuses))
        assert server.poll() is None
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        subprocess.run(["scancel", "-n", settings["job_name"]], check=False)
