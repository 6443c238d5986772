"""The launch dir is the trust anchor of a launch: the trainer sends the API key to whatever
URL its service.url names, and the server writes its config there. On a shared cluster the
workdir may be on group-writable scratch, so someone else may have planted the launch dir, a
symlink, a FIFO or a URL there. The trainer and the server refuse what is not theirs alone."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from orchard.launch.launch_dir import LaunchError, read_url, url_mac, write_atomically
from orchard.launch.processes import prepare_server, wait_for_server
from orchard.launch.recipe import Recipe


KEY = "launch-key"


def announced(url: str, key: str = KEY) -> str:
    """A URL file's content as the server writes it."""
    return f"{url}\nmac={url_mac(url, key)}\n"


def recipe_in(workdir: Path) -> Recipe:
    path = workdir / "launch.yaml"
    path.write_text(yaml.safe_dump({"platform": {"workdir": str(workdir / "work"), "wait_seconds": 3,
                                                 "backend": {"name": "local"}}}))
    recipe = Recipe.load(path)
    recipe.workdir.mkdir()
    return recipe


@pytest.fixture
def thief():
    """An HTTP server that answers /health, as one planted by someone else would, and keeps
    the Authorization headers it is sent."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def in_time(call, seconds: float = 10.0):
    """The call's result or exception, failing the test (not hanging it) when it blocks."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_the_trainer_takes_the_url_of_a_private_launch_dir(tmp_path, thief):
    recipe = recipe_in(tmp_path)
    recipe.launch_dir.mkdir(mode=0o700)
    recipe.url_file.write_text(announced(thief))
    assert wait_for_server(recipe, KEY) == thief


@pytest.mark.parametrize("content", [lambda url: announced(url, "an earlier launch's key"), lambda url: url + "\n",
                                     lambda url: f"{url}\nmac={'0' * 64}\n"],
                         ids=["another-key", "no-mac", "wrong-mac"])
def test_a_url_file_not_made_with_this_launchs_key_is_not_taken(tmp_path, thief, content):
    """Left by an earlier launch with another key (its server killed before it could remove
    it; its host and port may be anyone's by now), or written without the key: the trainer
    waits for this launch's server instead of sending its key there."""
    recipe = recipe_in(tmp_path)
    recipe.launch_dir.mkdir(mode=0o700)
    recipe.url_file.write_text(content(thief))
    with pytest.raises(TimeoutError):
        in_time(lambda: wait_for_server(recipe, KEY))


def test_the_trainer_needs_the_key_to_check_the_url_file(tmp_path, monkeypatch):
    monkeypatch.delenv("ORCHARD_API_KEY", raising=False)
    with pytest.raises(LaunchError, match="ORCHARD_API_KEY"):
        wait_for_server(recipe_in(tmp_path))


def test_a_launch_dir_others_can_write_is_refused(tmp_path, thief):
    recipe = recipe_in(tmp_path)
    recipe.launch_dir.mkdir()
    recipe.launch_dir.chmod(0o777)  # group-writable scratch: someone else's URL could be in it
    recipe.url_file.write_text(announced(thief))
    with pytest.raises(LaunchError, match="writable by others"):
        in_time(lambda: wait_for_server(recipe, KEY))
    with pytest.raises(LaunchError, match="writable by others"):
        prepare_server(recipe)


def test_a_symlinked_launch_dir_is_refused(tmp_path, thief):
    recipe = recipe_in(tmp_path)
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    (planted / "service.url").write_text(announced(thief))
    recipe.launch_dir.symlink_to(planted)
    with pytest.raises(LaunchError, match="not a directory of this user"):
        in_time(lambda: wait_for_server(recipe, KEY))
    with pytest.raises(LaunchError):
        prepare_server(recipe)
    assert not (planted / "server.yaml").exists()


def test_a_symlinked_url_file_is_refused(tmp_path, thief):
    recipe = recipe_in(tmp_path)
    recipe.launch_dir.mkdir(mode=0o700)
    (tmp_path / "elsewhere.url").write_text(announced(thief))
    recipe.url_file.symlink_to(tmp_path / "elsewhere.url")
    with pytest.raises(LaunchError):
        in_time(lambda: wait_for_server(recipe, KEY))


def test_a_url_file_others_can_write_is_refused(tmp_path, thief):
    recipe = recipe_in(tmp_path)
    recipe.launch_dir.mkdir(mode=0o700)
    recipe.url_file.write_text(announced(thief))
    recipe.url_file.chmod(0o666)
    with pytest.raises(LaunchError, match="writable by others"):
        in_time(lambda: wait_for_server(recipe, KEY))


def test_a_fifo_for_a_url_file_does_not_keep_the_trainer_waiting(tmp_path):
    recipe = recipe_in(tmp_path)
    recipe.launch_dir.mkdir(mode=0o700)
    os.mkfifo(recipe.url_file)
    with pytest.raises(LaunchError, match="not a regular file"):
        in_time(lambda: wait_for_server(recipe, KEY))


@pytest.mark.parametrize("text", ["data:,ok", "file:///etc/passwd", "http://a b:1", "http://h:1/x\nhttp://h:2"])
def test_what_is_not_a_server_url_is_refused(tmp_path, text):
    recipe = recipe_in(tmp_path)
    recipe.launch_dir.mkdir(mode=0o700)
    recipe.url_file.write_text(text + "\n")
    with pytest.raises(LaunchError, match="not a server URL"):
        in_time(lambda: wait_for_server(recipe, KEY))


def test_the_server_makes_its_launch_dir_private_and_follows_no_symlink_there(tmp_path):
    recipe = recipe_in(tmp_path)
    previous = os.umask(0)
    try:
        dir_fd, config = prepare_server(recipe)
        os.close(dir_fd)
    finally:
        os.umask(previous)
    assert oct(recipe.launch_dir.stat().st_mode & 0o777) == "0o700"
    assert oct(config.stat().st_mode & 0o777) == "0o600" and yaml.safe_load(config.read_text())["host"] == "0.0.0.0"
    # a symlink left at the config, its .part or the URL file is replaced or removed, its target untouched
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    config.unlink()
    config.symlink_to(victim)
    config.with_name("server.yaml.part").symlink_to(victim)
    recipe.url_file.symlink_to(victim)
    dir_fd, _ = prepare_server(recipe)
    os.close(dir_fd)
    assert victim.read_text() == "precious\n" and not config.is_symlink() and not recipe.url_file.exists()
    assert read_url(recipe, KEY) is None


def test_write_atomically_follows_no_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    target = tmp_path / "settings.yaml"
    target.symlink_to(victim)
    write_atomically(target, "api_key: k\n", 0o644)
    assert victim.read_text() == "precious\n" and oct(victim.stat().st_mode & 0o777) == "0o600"
    assert not target.is_symlink() and target.read_text() == "api_key: k\n"
    with pytest.raises(OSError):  # a path through a symlinked directory is not written either
        (tmp_path / "linked").symlink_to(tmp_path)
        write_atomically(tmp_path / "linked" / "other.yaml", "x\n")


def test_a_port_taken_by_someone_else_is_never_announced(tmp_path, thief):
    """Another user on the server's node holds the launch's port first and answers /health:
    the server cannot listen there and exits, and its URL (which would reach the squatter,
    the trainer sending it the key) is never written, not even for a moment."""
    import subprocess
    import sys
    import time

    port = int(thief.rsplit(":", 1)[1])
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump({"platform": {"workdir": str(tmp_path / "work"), "wait_seconds": 3,
                                                 "backend": {"name": "local"}},
                                    "server": {"port": port, "log_level": "warning"}}))
    recipe = Recipe.load(path)
    server = subprocess.Popen([sys.executable, "-m", "orchard.cli", "launch", "serve", "--config", str(path)],
                              env={**os.environ, "ORCHARD_API_KEY": "launch-key"}, stderr=subprocess.DEVNULL)
    announced = False
    deadline = time.monotonic() + 60
    while server.poll() is None and time.monotonic() < deadline:
        announced = announced or recipe.url_file.exists()
        time.sleep(0.005)
    if server.poll() is None:
        server.kill()
    assert server.wait() != 0 and not announced
