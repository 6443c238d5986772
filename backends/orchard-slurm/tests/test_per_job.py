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

from orchard.errors import InvalidRequest
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
        assert int(open_.exec("grep -c : /proc/net/dev").stdout) > 1
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
