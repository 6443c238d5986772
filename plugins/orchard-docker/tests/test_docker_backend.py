"""The docker backend against a real engine: Podman's Docker-compatible API service.

Life cycle and labels (a new backend finds what an old one made), lost containers with the
reason, typed image errors, what a sandbox can reach (not its key, its control directory,
another sandbox's agent, any capability), and what ``docker inspect`` shows (no key)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import docker
import pytest

from orchard.client import Client
from orchard.client.http import ApiClient
from orchard.errors import AuthenticationFailed, ImageRejected, InvalidRequest, SandboxConflict, SandboxNotFound
from orchard_docker import containers, control


@pytest.fixture
def client(docker_settings):
    made = Client(backend="docker", backend_settings=docker_settings)
    yield made
    made.close()


@pytest.fixture
def engine(podman):
    api = docker.APIClient(base_url=podman.url, version="auto", timeout=60)
    yield api
    api.close()


def name_of(sandbox_id: str) -> str:
    return containers.container_name("tests", sandbox_id)


def test_life_cycle_labels_and_a_restarted_backend(client, docker_settings, kit_image, engine):
    with client.create(kit_image, memory="256Mi", cpu="1", pids=64, labels={"suite": "docker"}) as box:
        assert box.info.status == "ready" and box.info.backend == "docker" and box.info.memory == "256Mi"
        assert box.exec("pwd; cat /etc/passwd | head -1").stdout == "/workspace\nroot:x:0:0:root:/root:/bin/bash\n"
        box.exec("echo kept > /tmp/state")
        attrs = engine.inspect_container(name_of(box.id))
        labels = attrs["Config"]["Labels"]
        assert labels[containers.SANDBOX_LABEL] == box.id and labels[containers.INSTANCE_LABEL] == "tests"
        again = Client(backend="docker", backend_settings=docker_settings)  # a restarted server finds it by label
        try:
            assert box.id in [s.sandbox_id for s in again.list()]
            assert again.get(box.id).exec("cat /tmp/state").stdout == "kept\n"
        finally:
            again.close()
        with pytest.raises(SandboxConflict, match="memory"):
            client.create(kit_image, sandbox_id=box.id, memory="512Mi", cpu="1", pids=64)
    assert engine.containers(all=True, filters={"name": name_of(box.id)}) == []
    with pytest.raises(SandboxNotFound):
        client.get(box.id).refresh()


def test_inspect_shows_no_key_and_no_privilege(client, kit_image, engine, docker_settings):
    with client.create(kit_image) as box:
        attrs = engine.inspect_container(name_of(box.id))
        document = json.dumps(attrs)
        key = control.control_dir(Path(docker_settings["state_dir"]), box.id).token()
        assert key and key not in document
        host = attrs["HostConfig"]
        assert host["Privileged"] is False and host["NetworkMode"] == "none"
        assert "no-new-privileges" in " ".join(host.get("SecurityOpt") or [])
        sources = sorted(m["Source"] for m in attrs["Mounts"])
        assert sources[0] == docker_settings["bundle_dir"] and len(sources) == 3
        assert all(s.startswith(docker_settings["state_dir"]) for s in sources[1:])


def test_a_sandbox_cannot_reach_its_key_control_directory_or_capabilities(client, kit_image):
    with client.create(kit_image) as box:
        job = box.exec("grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs)' /proc/self/status")
        assert all(line.split()[1] == "0000000000000000" for line in job.stdout.splitlines()[:5]), job.stdout
        assert job.stdout.splitlines()[5].split()[1] == "1"
        assert box.exec(f"wc -c < {containers.KEY_TARGET}").stdout.strip() == "0"  # emptied once the agent read it
        assert box.exec("cat /proc/1/environ").exit_code != 0  # the agent is not dumpable
        for attack in ("touch /run/orchard/planted", "rm -f /run/orchard/agent.sock", "chmod 777 /run/orchard",
                       "ln -s / /run/orchard/root", f"echo x > {containers.KEY_TARGET}"):
            assert box.exec(attack).exit_code != 0, attack
        assert box.exec("ls -A /run/orchard").stdout.split() == ["agent.sock"]
        assert box.exec("echo still-served").stdout == "still-served\n"


async def _call_with(url: str, token: str, path: str) -> None:
    api = ApiClient(url, token, retries=0)
    try:
        await api.request("GET", path)
    finally:
        await api.close()


def test_another_sandboxs_key_and_sandboxes_are_refused(client, kit_image, docker_settings):
    import asyncio

    with client.create(kit_image) as a, client.create(kit_image) as b:
        state = Path(docker_settings["state_dir"])
        where_a, where_b = control.control_dir(state, a.id), control.control_dir(state, b.id)
        with pytest.raises(AuthenticationFailed):  # a's key at b's agent
            asyncio.run(_call_with(f"unix://{where_b.socket}", where_a.token(), f"/sandboxes/{b.id}"))
        with pytest.raises(SandboxNotFound):  # b's agent knows only b
            asyncio.run(_call_with(f"unix://{where_b.socket}", where_b.token(), f"/sandboxes/{a.id}"))
        probe = f"ls {where_a.path} {where_b.path} {state}; ls /run/orchard | wc -l"
        assert a.exec(probe).stdout.splitlines()[-1] == "1"  # none of the host's control paths exist inside


def test_lost_containers_say_why(client, kit_image, engine):
    killed, removed = client.create(kit_image), client.create(kit_image)
    engine.kill(name_of(killed.id), "SIGKILL")
    engine.wait(name_of(killed.id), timeout=60)  # bounded: the kill is asynchronous
    engine.remove_container(name_of(removed.id), force=True)
    listed = {s.sandbox_id: s for s in client.list()}
    assert listed[killed.id].status == "lost" and "exit code 137" in listed[killed.id].status_message
    assert listed[removed.id].status == "lost"
    assert listed[removed.id].status_message == "its container was removed"
    assert client.get(killed.id).refresh().status == "lost"
    killed.delete()
    removed.delete()
    assert {killed.id, removed.id}.isdisjoint(s.sandbox_id for s in client.list())


def test_image_errors_are_typed_and_name_the_image(client, kit_image):
    with pytest.raises(ImageRejected, match="localhost:1/nothing-here:1"):
        client.create("docker://localhost:1/nothing-here:1")
    with pytest.raises(ImageRejected, match="not in the allowed registries"):
        client.create("docker://quay.io.invalid/x:1")
    with pytest.raises(InvalidRequest, match="disk"):  # overlay over ext4 here: no per-container quota
        client.create(kit_image, disk="1Gi")
    assert [s for s in client.list() if s.status != "ready"] == []


def _doctor(settings_file) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchard.cli", "doctor", "--backend", "docker", "--settings",
                           str(settings_file), "--json"], capture_output=True, text=True, timeout=120)


def test_doctor_passes_with_the_service_and_says_how_to_start_it_without(tmp_path, agent_bundle):
    from podman_service import PodmanService

    service = PodmanService().start()
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"docker_host": service.url, "bundle_dir": str(agent_bundle)}))
    try:
        running = _doctor(settings)
        assert running.returncode == 0, running.stdout + running.stderr
        assert {c["name"]: c["ok"] for c in json.loads(running.stdout)["checks"]}["engine API"]
    finally:
        service.destroy()
    stopped = _doctor(settings)
    assert stopped.returncode == 1
    failed = [c for c in json.loads(stopped.stdout)["checks"] if not c["ok"]]
    assert failed[0]["name"] in ("engine socket", "engine API")  # the socket file gone, or left with nobody behind it
    assert f"podman system service --time=0 {service.url}" in failed[0]["fix"]


def test_listed_and_core_works_without_the_plugin():
    listed = subprocess.run([sys.executable, "-m", "orchard.cli", "backends", "--json"], capture_output=True, text=True)
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["docker"]["distribution"] == "orchard-docker" and rows["docker"]["available"]
    # As if uninstalled: the entry point is not loaded; core and the other backends still work.
    env = {**__import__("os").environ, "ORCHARD_PLUGINS": "remote-agent"}
    without = subprocess.run([sys.executable, "-m", "orchard.cli", "backends", "--json"], capture_output=True,
                             text=True, env=env)
    names = {row["name"] for row in json.loads(without.stdout)}
    assert "docker" not in names and {"local", "remote-agent"} <= names
    doctor = subprocess.run([sys.executable, "-m", "orchard.cli", "doctor", "--backend", "docker"], capture_output=True,
                            text=True, env=env)
    assert doctor.returncode == 2 and "unknown backend 'docker'" in doctor.stderr
