"""``orchard launch``: the commands slurm/orchard-launch.sbatch and the k8s/launch/ manifests
run, with the launch file as their only argument (see orchard/launch/recipe.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import click

from orchard.cli.common import handle_errors, out

config_option = click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                             required=True, help="the launch file (slurm/launch.yaml, k8s/launch/launch.yaml)")


def _recipe(config_file: Path):
    from orchard.launch.recipe import Recipe

    try:
        recipe = Recipe.load(config_file)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    recipe.workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(recipe.workdir)  # relative paths of the file resolve in the workdir, on every platform
    return recipe


@click.group()
def launch() -> None:
    """A training launch: the Orchard server and the trainer, from one file."""


@launch.command("serve")
@config_option
@handle_errors
def serve(config_file: Path) -> None:
    """The Orchard server with the file's backend; its URL goes to <workdir>/launch/service.url."""
    from orchard.launch.launch_dir import LaunchError
    from orchard.launch.processes import serve as run

    try:
        code = run(_recipe(config_file))
    except LaunchError as exc:
        raise click.UsageError(str(exc)) from None
    sys.exit(code)


@launch.command("train")
@config_option
@click.option("--steps", type=int, default=None, help="stop after this many more steps (standalone)")
@handle_errors
def train(config_file: Path, steps: Optional[int]) -> None:
    """Wait for the server, then the standalone trainer (or slime's train.py) with the file's settings."""
    from orchard.launch.launch_dir import LaunchError
    from orchard.launch.processes import train as run

    try:
        records = run(_recipe(config_file), steps)
    except LaunchError as exc:  # a launch dir or URL file someone else could have written
        raise click.UsageError(str(exc)) from None
    if records:
        last = records[-1]
        out.print(f"step {last['step']}: success rate {last['success_rate']}, rollouts {last['rollouts']}")


@launch.command("get")
@config_option
@click.argument("key")
def get(config_file: Path, key: str) -> None:
    """Print one setting (dotted KEY, e.g. trainer): for the scripts' own decisions, such as starting Ray."""
    from orchard.launch.recipe import Recipe

    recipe = Recipe.load(config_file)
    value: object = {**recipe.data, "trainer": recipe.trainer}
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    click.echo("" if value is None else value)
