"""The charliecloud runtime for real: pilots on the dev cluster run each sandbox in a
ch-run container (wrapped in PID/IPC/UTS and, when asked, network namespaces), and
commands join it through orchard-enter like bubblewrap sandboxes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchard.bench.measure import count_processes
from orchard.errors import InvalidRequest, OrchardError
from orchard_slurm.runtimes.charliecloud import CharliecloudRuntime
from orchard.testing.isolation import host_listener  # noqa: F401  (a fixture)
from slurm_testing import busybox_probe, lost_soon, require, slurm_client, slurm_settings
from tests.images import busybox_rootfs
from tests.netlab import NetLab

OUTSIDE = "203.0.113.10"


@pytest.fixture(scope="module")
def lab():
    lab = NetLab().up()
    yield lab
    lab.down()


def holders() -> int:
    """Processes that are a sandbox's holder (argv[0] is the holder's path in the container)."""
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            count += entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"/.orchard-hold\0")
        except OSError:
            continue
    return count


@pytest.fixture(scope="module")
def charliecloud(slurm_cluster):
    require(CharliecloudRuntime)
    settings = slurm_settings(runtime="charliecloud", sandboxes_per_pilot=8, max_pilots=1, pilot_idle_seconds=30)
    image = busybox_rootfs(Path(settings["shared_dir"]) / "busybox-image")
    with slurm_client(settings) as client:
        yield client, str(image)


def test_commands_run_in_the_image_with_pid_namespace_and_state_across_commands(charliecloud):
    client, image = charliecloud
    before = holders()
    with client.create(image) as sandbox:
        assert sandbox.exec("busybox | head -1").stdout.startswith("BusyBox")
        assert sandbox.exec("test -e /usr/bin/python3 || echo no-host-python").stdout == "no-host-python\n"
        assert sandbox.exec("ls /proc | grep -c '^[0-9]'").stdout.strip() in {"2", "3", "4"}  # PID 1 and us
        assert sandbox.exec(f"kill -0 {os.getpid()} 2>/dev/null || echo invisible").stdout == "invisible\n"
        sandbox.exec("sleep 1000 & echo $! > /tmp/sleeper")
        assert sandbox.exec("kill -0 $(cat /tmp/sleeper) && echo alive").stdout == "alive\n"
        assert sandbox.exec("echo $HOME; touch ~/written && echo home-ok").stdout == "/root\nhome-ok\n"
        job = sandbox.exec("sleep 300 & sleep 300", timeout=1)
        assert job.exit_code == 124 and job.error_type == "timeout"
        sandbox.upload("data/in.txt", "through the agent\n")
        assert sandbox.exec("cat data/in.txt").stdout == "through the agent\n"
        sandbox.exec("echo made-inside > out.txt")
        assert sandbox.download("out.txt") == b"made-inside\n"
        assert holders() == before + 1
    assert holders() == before and count_processes("sleep 1000") == 0


def test_every_sandbox_has_its_own_network_namespace_and_open_ones_the_egress(charliecloud, lab, host_listener):
    """An open sandbox shared the node's network namespace (it reached slurmctld, the
    accounting database and every loopback port of the node); now it has its own, with the
    pilot agent's egress, and sysfs shows its own interfaces only."""
    client, image = charliecloud
    with client.create(image) as blocked, client.create(image, block_network=False) as open_:
        interfaces = "grep -c : /proc/net/dev"  # one line per interface
        assert blocked.exec(interfaces).stdout == "1\n"  # lo only
        assert open_.exec(interfaces).stdout == "2\n"  # lo and the egress's eth0
        assert open_.exec(busybox_probe(OUTSIDE)).stdout.startswith("hello-from-outside")
        assert "hello-from-host" not in open_.exec(busybox_probe("127.0.0.1", host_listener)).stdout
        for sandbox, expected in ((blocked, {"lo"}), (open_, {"lo", "eth0"})):
            listed = set(sandbox.exec("ls /sys/class/net /sys/devices/virtual/net 2>/dev/null").stdout.split())
            assert listed - {"/sys/class/net:", "/sys/devices/virtual/net:"} == expected, listed


def test_sandboxes_do_not_see_each_other_and_host_image_is_refused_clearly(charliecloud):
    client, image = charliecloud
    with client.create(image) as first, client.create(image) as second:
        first.exec("echo mine > /tmp/private; sleep 1000 & echo started")
        assert second.exec("cat /tmp/private 2>/dev/null || echo absent").stdout == "absent\n"
        assert "sleep 1000" not in second.exec("ps").stdout
    with pytest.raises(InvalidRequest, match="charliecloud runtime runs directory images"):
        client.create("host")


def test_an_image_whose_root_links_to_a_host_directory_cannot_have_it_chowned(charliecloud, tmp_path_factory):
    """The root agent chowned the image's /root and made ch-run's bind targets without
    resolving inside the image: a /root -> host directory link handed it to the sandbox."""
    client, image = charliecloud
    victim = Path(tmp_path_factory.mktemp("victim"))
    victim.chmod(0o755)
    before = victim.stat()
    hostile = busybox_rootfs(Path(image).parent / "hostile-image")
    (hostile / "root").rmdir()
    (hostile / "root").symlink_to(victim)  # absolute: on the host it names the victim
    try:
        with client.create(str(hostile)) as sandbox:
            sandbox.exec("touch /root/planted 2>/dev/null; true")
    except OrchardError:
        pass  # refusing the image is fine too; what matters is the host directory
    after = victim.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)
    assert list(victim.iterdir()) == []


def test_each_sandbox_has_a_private_minimal_dev_and_shm(charliecloud):
    """Charliecloud sandboxes saw the host's /dev (108 entries: /dev/kvm, /dev/fuse, block
    devices) and shared the host's /dev/shm with each other and every user of the node."""
    client, image = charliecloud
    with client.create(image) as first, client.create(image) as second:
        names = set(first.exec("ls /dev").stdout.split())
        assert names <= {"null", "zero", "full", "random", "urandom", "tty", "shm", "pts", "fd", "stdin", "stdout",
                         "stderr"}, names
        assert first.exec("echo x > /dev/null && head -c 4 /dev/zero | wc -c").stdout.strip() == "4"
        first.exec("echo secret > /dev/shm/orchard-shm-probe")
        assert second.exec("cat /dev/shm/orchard-shm-probe 2>/dev/null || echo unseen").stdout == "unseen\n"
        assert not Path("/dev/shm/orchard-shm-probe").exists()
        cgroups = first.exec("cat /proc/self/cgroup; ls -R /sys/fs/cgroup /sys/class/net 2>/dev/null").stdout
        assert second.id not in cgroups and first.id not in cgroups  # its own cgroup namespace, the tree hidden
        assert first.exec("ls /sys/fs/cgroup | wc -l").stdout.strip() == "0"


def test_sandboxes_die_with_a_hard_killed_pilot_and_leave_no_mounts(slurm_cluster):
    """After kill -9 of a pilot's agent its Charliecloud sandboxes kept running under
    orphaned unshare processes, outside Slurm's reach, and the pool removed the pilot's
    directory while their overlay mounts were live."""
    import json
    import signal
    import time

    from orchard.agent.runtimes.mounts import mounts_below

    settings = slurm_settings(runtime="charliecloud", sandboxes_per_pilot=4, max_pilots=1)
    shared = Path(settings["shared_dir"])
    image = busybox_rootfs(shared / "busybox-image")
    with slurm_client(settings) as client:
        before = holders()
        sandbox = client.create(str(image))
        sandbox.exec("sleep 1000 &")
        assert holders() == before + 1
        (record,) = shared.glob("pilots/*/agent/agent.json")
        os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while holders() > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert holders() == before, "a sandbox outlived its hard-killed agent"
        assert lost_soon(client, sandbox.id)
        client.delete(sandbox.id)
    assert not any("orchard-slurm-test" in str(p) and str(shared) in str(p) for p in mounts_below(Path("/")))


def test_etc_passwd_is_inside_the_disk_quota(charliecloud):
    """ch-run's own /etc/passwd was a deleted, sandbox-writable copy in the node's /tmp that
    du could not see: 1 GiB went into it under disk: 64M. With --no-passwd it is the image's,
    in the writable layer, under the quota."""
    client, image = charliecloud
    with client.create(image, disk="16M") as sandbox:
        job = sandbox.exec("head -c 64000000 /dev/zero >> /etc/passwd")
        assert job.exit_code != 0, job
        size = int(sandbox.exec("stat -c %s /etc/passwd").stdout)
        assert size <= 16 << 20, f"{size} bytes in /etc/passwd under a 16M quota"
