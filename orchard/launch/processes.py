"""The two processes of a launch: the Orchard server, which announces its URL in the workdir
once it answers, and the trainer, which waits for that URL. A file in the workdir works the
same on Slurm (a shared filesystem across the job's nodes) and in a pod (a shared volume)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

import yaml

from orchard.launch.launch_dir import (LaunchError, launch_api_key, open_launch_dir, read_url, unlink_in, url_mac,
                                       write_atomically)
from orchard.launch.recipe import Recipe


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket on ``port`` (Linux: /proc; True
    where there is no /proc to ask). Another user's process that took the port first answers
    /health too: the URL of a port that is not our server's is never announced."""
    wanted = set()
    tables = [table for table in ("/proc/net/tcp", "/proc/net/tcp6") if os.path.exists(table)]
    if not tables:
        return True
    for table in tables:
        with open(table) as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    wanted.add(f"socket:[{fields[9]}]")
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in descriptors:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:
            continue
    return False


def prepare_server(recipe: Recipe) -> tuple[int, Path]:
    """The checked launch dir (made 0700 where absent) without a URL file, and the server's
    config written in it: the dir's descriptor and the config's path."""
    dir_fd = open_launch_dir(recipe, create=True)
    try:
        unlink_in(dir_fd, recipe.url_file.name)
        config = recipe.launch_dir / "server.yaml"
        write_atomically(config, yaml.safe_dump(recipe.server_config()), 0o600, dir_fd=dir_fd)
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd, config


def serve(recipe: Recipe) -> int:
    """Run ``orchard serve`` until it exits or is sent SIGTERM, SIGINT or SIGUSR1 (passed on as
    SIGTERM: the server stops its idle pilots). SIGUSR1 is for Slurm: srun forwards it to the
    step, whereas a SIGTERM to srun kills the step KillWait seconds later, cleanup or not. The
    URL file exists exactly while the server answers."""
    if not os.environ.get("ORCHARD_API_KEY"):  # it listens on every interface of a shared cluster
        raise LaunchError("set ORCHARD_API_KEY: the launch's server listens on the cluster's network, and without "
                          "a key anyone who reaches it could run commands in its sandboxes")
    dir_fd, config = prepare_server(recipe)
    key_file = recipe.launch_dir / "api-key"
    try:
        # the key by an owner-only file, not the environment: what the server starts inherits its
        # environment (Slurm pilot jobs through sbatch's --export=ALL, the local backend's agents)
        write_atomically(key_file, os.environ["ORCHARD_API_KEY"] + "\n", 0o600, dir_fd=dir_fd)
        env = {k: v for k, v in os.environ.items() if k != "ORCHARD_API_KEY"}
        child = subprocess.Popen([sys.executable, "-m", "orchard.cli", "serve", "--config", str(config)],
                                 env={**env, "ORCHARD_API_KEY_FILE": str(key_file)})
    except BaseException:
        unlink_in(dir_fd, key_file.name)
        os.close(dir_fd)
        raise
    asked: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        asked.append(signum)
        child.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, stop)
    try:
        local = f"http://127.0.0.1:{recipe.port}"
        while child.poll() is None and not (listens(child.pid, recipe.port) and answers(local)):
            time.sleep(0.2)
        if child.poll() is None:
            url = recipe.advertised_url()
            write_atomically(recipe.url_file, f"{url}\nmac={url_mac(url, os.environ['ORCHARD_API_KEY'])}\n",
                             dir_fd=dir_fd)
            print(f"Orchard server: {recipe.advertised_url()}", flush=True)
        code = child.wait()
        return 0 if asked and code == -signal.SIGTERM else code  # it ended by the signal we passed on, as asked
    finally:
        unlink_in(dir_fd, recipe.url_file.name)
        if child.poll() is None:
            child.terminate()
            child.wait()
        unlink_in(dir_fd, key_file.name)
        os.close(dir_fd)


def wait_for_server(recipe: Recipe, api_key: Optional[str] = None) -> str:
    """The URL the server announced, once it answers (a stale file from an earlier run does
    not; one from an earlier run with another key is not even tried). ``api_key``: the
    launch's key (ORCHARD_API_KEY where None)."""
    key = launch_api_key(api_key)
    deadline = time.monotonic() + float(recipe.platform.get("wait_seconds", 600))
    while time.monotonic() < deadline:
        url = read_url(recipe, key)
        if url and answers(url):
            return url
        time.sleep(1)
    raise TimeoutError(f"no Orchard server answered through {recipe.url_file} in time")


def train(recipe: Recipe, steps: Optional[int] = None) -> list[dict[str, Any]]:
    """The standalone trainer in this process, or slime's ``train.py`` in its place (exec)."""
    url = wait_for_server(recipe)
    if recipe.trainer == "slime":
        settings = recipe.launch_dir / "orchard-slime.yaml"  # holds the API key: owner-only
        dir_fd = open_launch_dir(recipe)
        try:
            write_atomically(settings, yaml.safe_dump(recipe.slime_settings(url, os.environ.get("ORCHARD_API_KEY"))),
                             0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        command = recipe.slime_command()
        os.execvpe(command[0], command, {**os.environ, "ORCHARD_SLIME_CONFIG": str(settings)})
    from orchard.train.rl_run import run

    return asyncio.run(run(recipe.rl_config(url), progress=False, steps=steps))
