"""What the backend asks the engine for, checked without an engine: locked-down options,
names and socket paths valid for any sandbox id, typed refusals of bad settings and images."""

from __future__ import annotations

import random
import re
import string
from pathlib import Path

import pytest

from orchard.errors import ImageRejected, InvalidRequest
from orchard.models import SandboxSpec
from orchard_docker import containers, control
from orchard_docker.backend import DockerBackend
from orchard_docker.config import SOCKET_PATH_ROOM, UNIX_PATH_MAX, DockerConfig

DOCKER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]+$")  # the engine's container-name alphabet
ID_FIRST, ID_REST = string.ascii_letters + string.digits, string.ascii_letters + string.digits + "_.-"


def random_ids(count: int = 300) -> list[str]:
    """Sandbox ids drawn from the whole id pattern, all lengths (seeded: the same every run)."""
    rng = random.Random(16)
    return [rng.choice(ID_FIRST) + "".join(rng.choice(ID_REST) for _ in range(rng.randint(0, 62)))
            for _ in range(count)]


def test_names_and_socket_paths_are_valid_for_any_id(tmp_path):
    state = Path("/") / ("s" * (UNIX_PATH_MAX - SOCKET_PATH_ROOM - 1))  # the longest state_dir the settings accept
    names = set()
    for sandbox_id in random_ids():
        name = containers.container_name("default", sandbox_id)
        assert DOCKER_NAME.match(name) and len(name) <= 128, name
        names.add(name)
        where = control.control_dir(state, sandbox_id)
        assert len(str(where.socket)) <= UNIX_PATH_MAX and len(str(where.container_socket)) <= UNIX_PATH_MAX
    assert len(names) == 300
    assert containers.container_name("x", "Ab") != containers.container_name("x", "ab")


def test_options_are_locked_down():
    spec = SandboxSpec(image="docker://localhost/kit:1", sandbox_id="s1", memory="256Mi", cpu="500m", pids=50)
    options = containers.host_options(spec, bundle="/b", control="/c/run", key="/c/mounted-key", network="bridge",
                                      pids=82, ulimits={"nofile": 1024}, runtime=None)
    assert options["cap_drop"] == ["ALL"] and options["privileged"] is False and "cap_add" not in options
    assert options["security_opt"] == ["no-new-privileges"] and options["network_mode"] == "none"
    mounts = {m["Target"]: (m["Source"], m["ReadOnly"]) for m in options["mounts"]}
    assert mounts == {"/opt/orchard": ("/b", True), "/run/orchard": ("/c/run", False),
                      containers.KEY_TARGET: ("/c/mounted-key", True)}
    assert options["mem_limit"] == options["memswap_limit"] == 256 << 20
    assert options["nano_cpus"] == 500_000_000 and options["pids_limit"] == 82
    assert options["restart_policy"] == {"Name": "no"}
    labels = containers.labels(spec, "default")
    assert set(labels) == {containers.MANAGED_LABEL, containers.INSTANCE_LABEL, containers.SANDBOX_LABEL,
                           containers.SPEC_LABEL}
    assert containers.spec_of(labels)["memory"] == "256Mi"
    opened = containers.host_options(spec.model_copy(update={"block_network": False}), bundle="/b", control="/c",
                                     key="/k", network="bridge", pids=None, ulimits={}, runtime="runsc")
    assert opened["network_mode"] == "bridge" and opened["runtime"] == "runsc" and "pids_limit" not in opened


def test_lost_reasons_say_why():
    assert containers.lost_reason({"State": {"Status": "running"}}) is None
    assert "OOM-killed" in containers.lost_reason({"State": {"Status": "exited", "OOMKilled": True, "ExitCode": 137}})
    assert "exit code 3" in containers.lost_reason({"State": {"Status": "exited", "ExitCode": 3}})
    assert containers.lost_reason(None) == "its container was removed"


def test_bad_settings_name_the_key(monkeypatch):
    from orchard.client.aio import load_backend

    with pytest.raises(InvalidRequest, match="backend.settings.stat_dir: Extra inputs are not permitted"):
        load_backend("docker", {"stat_dir": "/tmp/x"})
    with pytest.raises(InvalidRequest, match="docker_host"):
        load_backend("docker", {"docker_host": "tcp://10.0.0.1:2375"})
    with pytest.raises(InvalidRequest, match="state_dir"):
        load_backend("docker", {"state_dir": "/tmp/" + "x" * 100})
    monkeypatch.setenv("DOCKER_HOST", "ssh://builder")
    with pytest.raises(InvalidRequest, match="docker_host: DOCKER_HOST=ssh://builder is a remote engine"):
        load_backend("docker", {})


def test_images_outside_the_engine_or_the_policy_are_rejected(tmp_path):
    backend = DockerBackend(DockerConfig(docker_host="unix:///nonexistent.sock", state_dir=tmp_path,
                                         registries=["localhost"]))
    for image in ("host", "/etc", "dir:///srv/image", "oras://x/y"):
        with pytest.raises(ImageRejected, match=re.escape(repr(image))):
            backend.reference(image)
    with pytest.raises(ImageRejected, match="not in the allowed registries"):
        backend.reference("docker://registry.invalid.example/steal:latest")
    assert backend.reference("docker://localhost/kit:1") == backend.reference("localhost/kit:1") == "localhost/kit:1"
    with pytest.raises(InvalidRequest, match="memory: at least 64Mi"):
        backend.check_limits(SandboxSpec(image="localhost/kit:1", memory="32Mi"))
