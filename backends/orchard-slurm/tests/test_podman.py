"""The podman runtime for real: pilots on the dev cluster run each sandbox as a Podman
container (runc), commands join it through orchard-enter and its cgroup, so Podman's
limits hold for them too."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.errors import ImageRejected, InvalidRequest
from orchard_slurm.runtimes.podman import PodmanRuntime
from orchard.testing.isolation import host_listener  # noqa: F401  (a fixture)
from slurm_testing import busybox_probe, require, slurm_client, slurm_settings
from tests.images import busybox_rootfs


@pytest.fixture(scope="module")
def podman(slurm_cluster):
    require(PodmanRuntime)
    # 8.25 GB for 8 sandboxes: 256 MiB for the agent, 1 GiB each
    settings = slurm_settings(runtime="podman", sandboxes_per_pilot=8, max_pilots=1, pilot_idle_seconds=30,
                              mem_per_pilot_gb=8.25)
    image = busybox_rootfs(Path(settings["shared_dir"]) / "busybox-image")
    with slurm_client(settings) as client:
        yield client, str(image)


def test_containers_run_commands_with_their_namespaces_and_limits(podman):
    client, image = podman
    with client.create(image) as sandbox, client.create(image, block_network=False, pids=40) as limited:
        assert sandbox.exec("id -u; hostname; pwd").stdout == f"0\n{sandbox.id}\n/workspace\n"  # root inside only
        assert sandbox.exec("ls /proc | grep -c '^[0-9]'").stdout.strip() in {"2", "3", "4"}
        assert sandbox.exec("grep -c : /proc/net/dev").stdout == "1\n"  # --network none
        assert limited.exec("grep -c : /proc/net/dev").stdout == "2\n"  # its own namespace: lo and the egress's eth0
        assert "max=64" in sandbox.exec("grep devpts /proc/self/mountinfo").stdout  # its terminals are capped
        sandbox.exec("sleep 1000 & echo $! > /tmp/sleeper")
        assert sandbox.exec("kill -0 $(cat /tmp/sleeper) && echo alive").stdout == "alive\n"
        job = limited.exec("for i in $(seq 60); do sleep 30 & done; echo spawned", timeout=20)
        assert "can't fork" in job.stderr or "Resource temporarily unavailable" in job.stderr  # the pids limit
        sandbox.upload("data/in.txt", "through the agent\n")
        assert sandbox.exec("cat data/in.txt").stdout == "through the agent\n"
        sandbox.exec("echo made-inside > out.txt")
        assert sandbox.download("out.txt") == b"made-inside\n"
        job = sandbox.exec("sleep 300 & sleep 300", timeout=1)
        assert job.exit_code == 124 and job.error_type == "timeout"


def test_host_image_is_refused_clearly(podman):
    client, _ = podman
    with pytest.raises(InvalidRequest, match="podman runtime runs images"):
        client.create("host")


def test_podman_sandboxes_get_the_agents_default_limits_and_see_no_cgroup_tree(podman):
    """Podman sandboxes had no memory limit unless asked (pids 2048 from Podman, not the
    agent's defaults) and saw the node's whole cgroup tree, every sandbox id in it."""
    client, image = podman
    with client.create(image) as sandbox, client.create(image, memory="512M") as sized:
        limits = sandbox.exec("cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max "
                              "/sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max 2>/dev/null").stdout.split()
        assert str(1 << 30) in limits and "4096" in limits  # its share of the pilot's memory; default_pids 4096
        sized_limit = sized.exec("cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max "
                                 "2>/dev/null").stdout.split()
        assert any(abs(int(v) - 512_000_000) < 4096 for v in sized_limit if v.isdigit())  # 10^6 bytes, not MiB
        tree = sandbox.exec("cat /proc/self/cgroup; ls -R /sys/fs/cgroup 2>/dev/null | grep -c libpod").stdout
        assert sized.id not in tree and "libpod-" not in tree.split("\n")[0]


def test_podman_images_pass_the_image_policy(podman):
    """The policy ran only in the agent's own image store, which Podman never used."""
    client, _ = podman
    for image in ("/etc", "docker://evil.example/steal:latest"):
        with pytest.raises(ImageRejected, match="refused by policy"):
            client.create(image)


def test_a_disk_quota_podman_cannot_enforce_is_refused_not_dropped(podman):
    client, image = podman
    with pytest.raises(InvalidRequest, match="disk"):
        client.create(image, disk="1Gi")


def test_an_open_container_reaches_the_outside_not_the_nodes_loopback(podman, host_listener):
    from tests.netlab import NetLab

    client, image = podman
    lab = NetLab().up()
    try:
        with client.create(image, block_network=False) as open_:
            assert open_.exec(busybox_probe("203.0.113.10")).stdout.startswith("hello-from-outside")
            assert "hello-from-host" not in open_.exec(busybox_probe("127.0.0.1", host_listener)).stdout
    finally:
        lab.down()
