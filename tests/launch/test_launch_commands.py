"""`orchard launch serve|train` on this machine (the local backend): the server announces its
URL in the workdir only while it answers and stops on SIGUSR1 (what the sbatch script sends
through srun), a stale URL is not taken, and with `trainer: slime` the trainer hands slime's
train.py its flags and an ORCHARD_SLIME_CONFIG naming the server. slime cannot be installed
here: its train.py is a stand-in that records what it was given and calls the server with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchard.launch.processes import wait_for_server
from orchard.launch.recipe import SLIME_FLAGS, Recipe
from tests.images import free_port

STAND_IN = """import json, os, sys, yaml
from orchard.client import Client
settings = yaml.safe_load(open(os.environ["ORCHARD_SLIME_CONFIG"]))
with Client(settings["server_url"], settings["api_key"]) as client:
    listed = client.list()
json.dump({"argv": sys.argv[1:], "settings": settings, "cwd": os.getcwd(), "listed": len(listed),
           "mode": oct(os.stat(os.environ["ORCHARD_SLIME_CONFIG"]).st_mode & 0o777)}, open("slime-ran.json", "w"))
"""


def launch_file(workdir: Path, **extra) -> Path:
    data = {"platform": {"workdir": str(workdir), "wait_seconds": 60, "slime_dir": str(workdir / "slime"),
                         "backend": {"name": "local"}},
            "server": {"port": free_port(), "log_level": "warning"}, **extra}
    path = workdir / "launch.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def orchard(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "ORCHARD_API_KEY": "launch-key"}
    return subprocess.Popen([sys.executable, "-m", "orchard.cli", "launch", *args], env=env, **kwargs)


def test_the_server_announces_itself_while_it_answers_and_the_slime_trainer_gets_it(tmp_path):
    (tmp_path / "slime").mkdir()
    (tmp_path / "slime" / "train.py").write_text(STAND_IN)
    config = launch_file(tmp_path, trainer="slime",
                         slime={"orchard": {"max_rollouts": 16}, "args": ["--n-samples-per-prompt", "8"]})
    recipe = Recipe.load(config)
    server = orchard("serve", "--config", str(config))
    try:
        url = wait_for_server(recipe, "launch-key")
        trainer = orchard("train", "--config", str(config))
        assert trainer.wait(timeout=120) == 0
        ran = json.loads((tmp_path / "slime-ran.json").read_text())
        assert ran["argv"] == ["--n-samples-per-prompt", "8", *[x for pair in SLIME_FLAGS.items() for x in pair]]
        assert ran["settings"] == {"max_rollouts": 16, "server_url": url, "api_key": "launch-key"}
        assert ran["cwd"] == str(tmp_path) and ran["listed"] == 0 and ran["mode"] == "0o600"
    finally:
        server.send_signal(signal.SIGUSR1)
        assert server.wait(timeout=60) == 0
    assert not recipe.url_file.exists()


def test_a_stale_url_from_an_earlier_run_is_not_taken(tmp_path):
    recipe = Recipe.load(launch_file(tmp_path))
    recipe.launch_dir.mkdir(mode=0o700)  # the launch refuses one others can write
    recipe.url_file.write_text(f"http://127.0.0.1:{free_port()}\n")  # nothing answers there
    recipe.platform["wait_seconds"] = 2
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        wait_for_server(recipe, "launch-key")
    assert time.monotonic() - started >= 2


def test_a_launch_file_with_an_unknown_key_is_refused(tmp_path):
    config = launch_file(tmp_path, trainr="slime")
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "launch", "get", "--config", str(config), "trainer"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "trainr" in result.stderr
    config = launch_file(tmp_path)
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "launch", "get", "--config", str(config), "trainer"],
                            capture_output=True, text=True)
    assert result.stdout.strip() == "standalone"  # the default the sbatch script's Ray guard reads


def test_the_server_refuses_to_start_without_an_api_key(tmp_path):
    """It listens on every interface of a shared cluster: without a key, anyone who reaches it
    could create sandboxes and run commands in them."""
    config = launch_file(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "ORCHARD_API_KEY"}
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "launch", "serve", "--config", str(config)],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2 and "ORCHARD_API_KEY" in result.stderr
    assert not Recipe.load(config).url_file.exists()


def test_a_private_file_is_created_owner_only(tmp_path):
    """Created with its mode (O_EXCL), not written world-readable and then chmodded."""
    from orchard.launch.launch_dir import write_atomically

    target = tmp_path / "settings.yaml"
    (tmp_path / "settings.yaml.part").write_text("left by a killed writer")
    previous = os.umask(0o022)
    try:
        write_atomically(target, "api_key: secret\n", 0o600)
    finally:
        os.umask(previous)
    assert oct(target.stat().st_mode & 0o777) == "0o600" and target.read_text() == "api_key: secret\n"
    assert not (tmp_path / "settings.yaml.part").exists()


def test_the_server_gets_its_key_by_an_owner_only_file_not_its_environment(tmp_path):
    """What the server starts inherits its environment: Slurm pilot jobs (sbatch exports it
    all), the local backend's agents. The key is not in it: the server reads an owner-only
    file in the launch dir, removed when it stops; the key still guards every route."""
    import httpx

    config = launch_file(tmp_path)
    recipe = Recipe.load(config)
    server = orchard("serve", "--config", str(config))
    try:
        url = wait_for_server(recipe, "launch-key")
        [child] = [int(pid) for pid in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()]
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        assert not [entry for entry in environ if entry.startswith(b"ORCHARD_API_KEY=")]
        key_file = recipe.launch_dir / "api-key"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600" and key_file.read_text() == "launch-key\n"
        assert httpx.get(url + "/sandboxes").status_code == 401
        assert httpx.get(url + "/sandboxes", headers={"X-API-Key": "launch-key"}).status_code == 200
    finally:
        server.send_signal(signal.SIGUSR1)
        assert server.wait(timeout=60) == 0
    assert not (recipe.launch_dir / "api-key").exists() and not recipe.url_file.exists()
