"""``orchard bench slurm``, added to the ``orchard`` CLI through the ``orchard_add_commands`` hook."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import click

from orchard.cli.bench import report
from orchard.cli.common import handle_errors


@click.command("slurm")
@click.option("--settings", "settings_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="YAML: the slurm backend's settings (default: a fresh shared dir in /tmp, "
                                 "loopback agents, pilots cancelled when idle)")
@click.option("--runtime", default="bwrap", show_default=True, help="the agents' isolation runtime")
@click.option("--mode", type=click.Choice(["pilot", "per-job"]), default="pilot", show_default=True)
@click.option("--image", default="host", show_default=True,
              help="image of every sandbox (charliecloud needs a directory or docker:// image)")
@click.option("-n", "--sandboxes", type=int, default=100, show_default=True, help="for the end-to-end run")
@click.option("-c", "--concurrency", type=int, default=32, show_default=True)
@click.option("--samples", type=int, default=50, show_default=True, help="sequential creates; 4x as many execs")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@handle_errors
def bench_slurm(settings_file: Optional[Path], runtime: str, mode: str, image: str, sandboxes: int, concurrency: int, samples: int,
                output: Optional[Path]) -> None:
    """Pilot start, sandbox ready on a warm pilot, exec round trip, N sandboxes end to end."""
    import yaml

    from orchard_slurm.bench import default_settings, measure

    settings = {**default_settings(runtime), "mode": mode}
    if settings_file is not None:
        settings.update(yaml.safe_load(settings_file.read_text()) or {})
    result = asyncio.run(measure(settings, image, sandboxes, samples, concurrency))
    report(result, f"orchard bench slurm --mode {settings['mode']} --runtime {settings['runtime']} -n {sandboxes}", output)
    if result["succeeded"] != sandboxes:
        raise SystemExit(1)
