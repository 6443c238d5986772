"""The apptainer runtime's own code for real (instance start through spython in a child
process, the instance's PID, commands joining it through orchard-enter, loss noticed
through a pidfd, stop), on pilots of the dev cluster. Apptainer itself cannot be
installed here: ``fake_apptainer/singularity`` is a TEST DOUBLE that answers spython's
commands with a Charliecloud container (see its header for what it ignores)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from orchard.client import Client
from orchard.errors import InvalidRequest, SandboxLost
from orchard_slurm.runtimes.charliecloud import CharliecloudRuntime
from slurm_testing import require, slurm_settings, wait_until_no_jobs
from tests.images import busybox_rootfs

FAKE = Path(__file__).parent / "fake_apptainer"
CH_RUN_POINTS = ("dev", "proc", "sys", "tmp", "etc", "home", "mnt")


@pytest.fixture(scope="module")
def apptainer(slurm_cluster):
    require(CharliecloudRuntime)  # what the test double runs underneath
    settings = slurm_settings(runtime="apptainer", max_pilots=1, pilot_idle_seconds=30)
    shared = Path(settings["shared_dir"])
    image = busybox_rootfs(shared / "image")  # read-only under the double: it needs its mount points
    for point in CH_RUN_POINTS:
        (image / point).mkdir(exist_ok=True)
    for name in ("hosts", "resolv.conf", "group", "passwd"):
        (image / "etc" / name).touch()
    state, log = shared / "fake-apptainer-state", shared / "fake-apptainer.log"
    state.mkdir()
    log.touch()
    for path in (state, log):
        path.chmod(0o777)  # the double runs as the unprivileged sandbox owner under a root agent
    saved = {name: os.environ.get(name) for name in ("PATH", "APPTAINER_FAKE_STATE", "APPTAINER_FAKE_LOG")}
    os.environ.update(PATH=f"{FAKE}:{os.environ['PATH']}", APPTAINER_FAKE_STATE=str(state),
                      APPTAINER_FAKE_LOG=str(log))  # the pilot job inherits them (sbatch --export=ALL)
    client = Client(backend="slurm", backend_settings=settings)
    try:
        yield client, str(image), state, log
    finally:
        client.close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        assert wait_until_no_jobs(settings["job_name"]) == []


def test_instances_run_commands_in_their_namespaces_and_stop(apptainer):
    client, image, state, log = apptainer
    with client.create(image) as sandbox:
        (record,) = [json.loads(p.read_text()) for p in state.glob("*.json")]
        assert record["instance"] == f"orchard-{sandbox.id}"
        assert sandbox.exec("busybox | head -1").stdout.startswith("BusyBox")
        assert sandbox.exec("cat /proc/1/cmdline | tr '\\0' ' '").stdout == "/bin/sleep 1000000 "  # the instance's PID 1
        # No interfaces: this shows only that commands joined the TEST DOUBLE's network namespace,
        # which the double makes itself; that Apptainer blocks the network rests on the
        # "--net --network none" asserted below and in the golden command lines.
        assert sandbox.exec("grep -c : /proc/net/dev").stdout == "1\n"
        sandbox.exec("sleep 777 & echo $! > /tmp/sleeper")
        assert sandbox.exec("kill -0 $(cat /tmp/sleeper) && echo alive").stdout == "alive\n"
        assert sandbox.exec("echo via-tmp > /tmp/x; cat /tmp/x").stdout == "via-tmp\n"
        commands = log.read_text()
        assert "instance start --containall --no-home --cleanenv --hostname" in commands
        assert "--net --network none" in commands
    assert list(state.glob("*.json")) == []  # instance stop ran
    assert "instance stop -t 5 orchard-" in log.read_text()


def test_an_instance_that_dies_reads_lost_and_host_is_refused(apptainer):
    client, image, state, _ = apptainer
    sandbox = client.create(image)
    (record,) = [json.loads(p.read_text()) for p in state.glob("*.json")]
    os.kill(record["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while client.get(sandbox.id).info.status != "lost":
        assert time.monotonic() < deadline, "the instance's death was not noticed"
        time.sleep(0.1)
    with pytest.raises(SandboxLost):
        sandbox.exec("true")
    sandbox.delete()
    with pytest.raises(InvalidRequest, match="apptainer runtime runs images"):
        client.create("host")
