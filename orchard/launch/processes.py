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

from orchard.launch.recipe import Recipe


class LaunchError(Exception):
    """A launch that cannot start as configured (the CLI reports it as a usage error)."""


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    """Readers never see a half-written file (the trainer polls the URL file), and a file of
    mode 0600 is never readable by others, not even for a moment (it may hold the API key)."""
    part = path.with_name(path.name + ".part")
    part.unlink(missing_ok=True)
    with os.fdopen(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as handle:
        handle.write(text)
    part.chmod(mode)  # the umask may have taken bits away
    part.replace(path)


def serve(recipe: Recipe) -> int:
    """Run ``orchard serve`` until it exits or is sent SIGTERM, SIGINT or SIGUSR1 (passed on as
    SIGTERM: the server stops its idle pilots). SIGUSR1 is for Slurm: srun forwards it to the
    step, whereas a SIGTERM to srun kills the step KillWait seconds later, cleanup or not. The
    URL file exists exactly while the server answers."""
    if not os.environ.get("ORCHARD_API_KEY"):  # it listens on every interface of a shared cluster
        raise LaunchError("set ORCHARD_API_KEY: the launch's server listens on the cluster's network, and without "
                          "a key anyone who reaches it could run commands in its sandboxes")
    recipe.launch_dir.mkdir(parents=True, exist_ok=True)
    recipe.url_file.unlink(missing_ok=True)
    config = recipe.launch_dir / "server.yaml"
    config.write_text(yaml.safe_dump(recipe.server_config()))
    child = subprocess.Popen([sys.executable, "-m", "orchard.cli", "serve", "--config", str(config)])
    asked: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        asked.append(signum)
        child.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, stop)
    try:
        local = f"http://127.0.0.1:{recipe.port}"
        while child.poll() is None and not answers(local):
            time.sleep(0.2)
        if child.poll() is None:
            write_atomically(recipe.url_file, recipe.advertised_url() + "\n")
            print(f"Orchard server: {recipe.advertised_url()}", flush=True)
        code = child.wait()
        return 0 if asked and code == -signal.SIGTERM else code  # it ended by the signal we passed on, as asked
    finally:
        recipe.url_file.unlink(missing_ok=True)
        if child.poll() is None:
            child.terminate()
            child.wait()


def wait_for_server(recipe: Recipe) -> str:
    """The URL the server announced, once it answers (a stale file from an earlier run does not)."""
    deadline = time.monotonic() + float(recipe.platform.get("wait_seconds", 600))
    while time.monotonic() < deadline:
        if recipe.url_file.exists():
            url = recipe.url_file.read_text().strip()
            if url and answers(url):
                return url
        time.sleep(1)
    raise TimeoutError(f"no Orchard server answered through {recipe.url_file} in time")


def train(recipe: Recipe, steps: Optional[int] = None) -> list[dict[str, Any]]:
    """The standalone trainer in this process, or slime's ``train.py`` in its place (exec)."""
    url = wait_for_server(recipe)
    if recipe.trainer == "slime":
        settings = recipe.launch_dir / "orchard-slime.yaml"  # holds the API key: owner-only
        write_atomically(settings, yaml.safe_dump(recipe.slime_settings(url, os.environ.get("ORCHARD_API_KEY"))),
                         0o600)
        command = recipe.slime_command()
        os.execvpe(command[0], command, {**os.environ, "ORCHARD_SLIME_CONFIG": str(settings)})
    from orchard.train.rl_run import run

    return asyncio.run(run(recipe.rl_config(url), progress=False, steps=steps))
