"""Per-job mode on the dev cluster: each sandbox is a Slurm job of its own whose container
(bubblewrap or Charliecloud) runs the bundled agent; the service reaches it through the
job's TCP relay with a token."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from orchard.agent.tokens import sandbox_token
from orchard.errors import InvalidRequest, OrchardError
from orchard_slurm.config import SlurmConfig
from slurm_testing import slurm_client, slurm_settings, squeue_jobs
from tests.images import busybox_rootfs


@pytest.fixture(scope="module", params=["bwrap", "charliecloud"])
def per_job(request, slurm_cluster, agent_bundle):
    settings = slurm_settings(mode="per-job", runtime=request.param, max_pilots=3, bundle_dir=str(agent_bundle))
    image = busybox_rootfs(Path(settings["shared_dir"]) / "image")
    with slurm_client(settings) as client:
        yield client, str(image), settings["job_name"], Path(settings["shared_dir"])


def live_jobs(job_name: str) -> set[str]:
    return {line.split()[0] for line in squeue_jobs(job_name)}


def test_each_sandbox_is_a_slurm_job_with_the_agent_inside_its_container(per_job):
    client, image, job_name, shared = per_job
    with client.create(image) as blocked, client.create(image, block_network=False) as open_:
        jobs = live_jobs(job_name)
        assert len(jobs) == 2  # one Slurm job per sandbox
        assert blocked.info.image == image and blocked.info.runtime == "direct"
        assert "/opt/orchard/" in blocked.exec("cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
        assert blocked.exec("grep -c : /proc/net/dev").stdout == "1\n"  # lo only: no way out
        assert open_.exec("grep -c : /proc/net/dev").stdout == "2\n"  # its own namespace: lo and the egress's eth0
        devpts = blocked.exec("grep devpts /proc/self/mountinfo || echo none").stdout
        assert "max=64" in devpts or devpts == "none\n", devpts  # a devpts (bwrap's) is capped; Charliecloud has none
        assert blocked.exec("echo kept > /tmp/state; cat /tmp/state").stdout == "kept\n"
        assert "ORCHARD_AGENT_TOKEN" not in blocked.exec("env").stdout
        for record in shared.glob("pilots/*/agent/agent.json"):  # the relays are not open doors
            address = json.loads(record.read_text())["address"]
            assert httpx.get(f"{address}/sandboxes", timeout=5).status_code == 401
    deadline = time.monotonic() + 20
    while live_jobs(job_name) & jobs and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_jobs(job_name) & jobs  # delete ended each job


def test_scancel_of_a_sandbox_job_reads_lost_and_bad_images_submit_nothing(per_job):
    client, image, job_name, _ = per_job
    sandbox = client.create(image)
    (job_id,) = live_jobs(job_name)
    subprocess.run(["scancel", job_id], check=True)
    deadline = time.monotonic() + 10
    while (info := client.get(sandbox.id).info).status != "lost":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert f"Slurm job {job_id}" in info.status_message
    sandbox.delete()
    with pytest.raises(InvalidRequest, match="docker:// or directory images|ask for an image"):
        client.create("host")
    assert live_jobs(job_name) == set()  # refused before anything was submitted


def test_a_docker_image_from_a_registry_keeps_its_environment_and_workdir(per_job, tmp_path_factory):
    """Pulled and unpacked once by the job (the agent's image store), run with the image's
    ENV and WORKDIR; a real registry on loopback."""
    from tests.images import Registry, have_image_tools

    assert have_image_tools(), "make system-deps installs docker-registry, skopeo and umoci"
    client, image, job_name, shared = per_job
    registry = Registry(Path(tempfile.mkdtemp(prefix="orchard-registry-", dir="/tmp")))
    try:
        root = Path(image)
        (root / "srv" / "app").mkdir(parents=True, exist_ok=True)
        reference = registry.push_rootfs(root, f"perjob-{root.parent.name}", {"GREETING": "from-the-image",
                                                                            "PATH": "/bin:/sbin"}, "/srv/app")
        with client.create(reference) as sandbox:
            assert sandbox.info.image == reference
            assert sandbox.exec("echo $GREETING; pwd").stdout == "from-the-image\n/srv/app\n"
            assert sandbox.exec("echo kept > /tmp/f; cat /tmp/f").stdout == "kept\n"
        assert list((shared / "image-cache").glob("sha256-*/rootfs"))  # unpacked once, kept for the next job
    finally:
        registry.stop()
        shutil.rmtree(registry.workdir, ignore_errors=True)


def test_a_sandbox_cannot_point_the_relay_at_another_socket(per_job):
    """The relay used to connect to agent.sock in a folder bound read-write into the
    sandbox: replacing it with a symlink to munge's socket handed callers of the relay a
    munge credential for the job's owner (root here). Now the socket never appears inside."""
    client, image, _, shared = per_job
    with client.create(image) as sandbox:
        attack = sandbox.exec("for d in /orchard-run /orchard-run/state /tmp /tmp/.orchard-agent; do "
                              "  [ -S $d/agent.sock ] && mv $d/agent.sock $d/real.sock; "
                              "  ln -sf /run/munge/munge.socket.2 $d/agent.sock 2>/dev/null; done; "
                              "ls -la /proc/1/fd 2>/dev/null | grep -c socket || true")
        assert attack.exit_code == 0
        (record,) = [r for r in shared.glob("pilots/*/agent/agent.json")]
        address = json.loads(record.read_text())["address"]
        token = (record.parent / "token").read_text().strip()
        answer = httpx.get(f"{address}/sandboxes/{sandbox.id}", headers={"X-API-Key": token}, timeout=10)
        assert answer.status_code == 200 and answer.json()["sandbox_id"] == sandbox.id  # still the agent
        assert sandbox.exec("echo still-reachable").stdout == "still-reachable\n"


def test_the_relay_checks_keys_before_relaying_and_drops_silent_connections(per_job):
    import socket as sockets

    client, image, _, shared = per_job
    with client.create(image) as sandbox:
        (record,) = [r for r in shared.glob("pilots/*/agent/agent.json")]
        address = json.loads(record.read_text())["address"]
        host, port = address.removeprefix("http://").rsplit(":", 1)
        assert httpx.get(f"{address}/health", timeout=5).status_code == 401  # not even liveness without a key
        assert httpx.get(f"{address}/sandboxes", headers={"X-API-Key": "sbx." + "0" * 48}, timeout=5).status_code == 401
        token = (record.parent / "token").read_text().strip()
        own = sandbox_token(token, sandbox.id, client.get(sandbox.id).info.incarnation)
        assert httpx.get(f"{address}/sandboxes/{sandbox.id}", headers={"X-API-Key": own}, timeout=5).status_code == 200
        silent = sockets.create_connection((host, int(port)), timeout=30)
        started = time.monotonic()
        assert silent.recv(1) == b""  # closed by the relay, no byte relayed
        assert time.monotonic() - started < 15
        silent.close()
        assert sandbox.exec("echo fine").stdout == "fine\n"


def agent_host_uids() -> set[int]:
    """Host uids of the per-job agents running on this node (seen from the host)."""
    uids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"/opt/orchard/python" in (entry / "cmdline").read_bytes():
                status = (entry / "status").read_text()
                uids.add(int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1]))
        except (OSError, StopIteration):
            continue
    return uids


def test_each_per_job_sandbox_runs_as_a_host_uid_of_its_own(per_job):
    """Every per-job container ran as host uid 100000: on clusters whose accounts reach that
    range, a real user owned every sandbox on the node."""
    client, image, _, _ = per_job
    with client.create(image) as first, client.create(image) as second:
        assert first.exec("id -u").exit_code == 0 and second.exec("id -u").exit_code == 0
        uids = agent_host_uids()
        base = SlurmConfig.model_fields["host_uid"].default
        assert len(uids) >= 2 and all(base < uid < base + 65536 for uid in uids)


def test_limits_a_per_job_sandbox_cannot_have_are_refused_before_submitting(per_job):
    """memory="512M" used to submit a job, answer 429, and leave the job running."""
    client, image, job_name, _ = per_job
    before = live_jobs(job_name)
    with pytest.raises(InvalidRequest, match="memory"):
        client.create(image, memory="512M")
    assert live_jobs(job_name) == before


def test_per_job_commands_do_not_inherit_the_agents_socket(per_job):
    """fd 3, the agent's listening socket, reached every command: one took it over and
    answered the relay as the agent, collecting the master key."""
    client, image, _, _ = per_job
    with client.create(image) as sandbox:
        fds = sandbox.exec("for f in /proc/$$/fd/*; do readlink $f; done").stdout
        assert "socket:" not in fds, fds


def test_a_per_job_sandbox_that_fails_to_start_leaves_no_job(per_job):
    client, _, job_name, _ = per_job
    before = live_jobs(job_name)
    with pytest.raises(OrchardError):
        client.create("docker://127.0.0.1:9/nothing-listens-here:latest", timeout=60)
    deadline = time.monotonic() + 20
    while live_jobs(job_name) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_jobs(job_name) == before


def test_a_per_job_sandbox_cannot_fill_the_shared_filesystem(per_job):
    """Its writable layer was on shared_dir with no limit (3 GiB went in from a job of 2 GB);
    now it is a tmpfs of half the job's memory, off the shared filesystem."""
    client, image, _, shared = per_job
    with client.create(image) as sandbox:
        job = sandbox.exec("head -c 1500000000 /dev/zero > /workspace/big", timeout=120)
        assert job.exit_code != 0, job  # busybox's head says "I/O error" for ENOSPC
        assert int(sandbox.exec("stat -c %s /workspace/big").stdout) <= 1 << 30  # half of the job's 2 GB
        layers = subprocess.run(["findmnt", "-rn", "-t", "tmpfs", "-o", "TARGET"], capture_output=True,
                                text=True).stdout.split()
        assert [t for t in layers if t.startswith(str(shared)) and t.endswith("/container/layer")], layers
        on_shared = subprocess.run(["du", "-sxb", str(shared / "pilots")], capture_output=True, text=True).stdout
        assert int(on_shared.split()[0]) < 64 << 20, on_shared  # nothing of it on the shared filesystem
        assert sandbox.exec("rm -f /workspace/big && echo freed").stdout == "freed\n"
