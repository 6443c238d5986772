"""The plugin's commands, added to the ``orchard`` CLI through the ``orchard_add_commands``
hook: ``orchard bench slurm`` and ``orchard slurm pilots | cancel-all``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

import click
from rich.table import Table

from orchard.cli.bench import report
from orchard.cli.common import handle_errors, json_option, out, print_json

config_option = click.option(
    "--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
    help="the service's orchard.yaml (its backend.settings), or a YAML of the slurm settings alone")


def load_settings(path: Path) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    return data["backend"].get("settings", {}) if isinstance(data.get("backend"), dict) else data


@click.group("slurm")
def slurm_group() -> None:
    """The Slurm backend's jobs: see them, cancel them."""


@slurm_group.command("pilots")
@config_option
@json_option
@handle_errors
def pilots(config_file: Path, as_json: bool) -> None:
    """This service's jobs in Slurm: pilot, state, agent address, sandboxes, walltime left."""
    from orchard_slurm.backend import SlurmBackend

    async def main() -> list[dict]:
        backend = SlurmBackend.from_settings(load_settings(config_file))
        try:
            return await backend.pilot_jobs()
        finally:
            await backend.close()  # connections only: every job stays

    rows = asyncio.run(main())
    if as_json:
        print_json(rows)
        return
    table = Table("job", "state", "pilot", "address", "sandboxes", "walltime left")
    for row in rows:
        left = row["remaining_seconds"]
        table.add_row(row["job_id"], row["state"], row["pilot"] or "[yellow]orphan[/yellow]", row["address"] or "-",
                      str(row["sandboxes"]) if row["sandboxes"] is not None else "-",
                      f"{left // 60} min" if left is not None else "-")
    out.print(table)


@slurm_group.command("cancel-all")
@config_option
@click.option("--yes", is_flag=True, help="do not ask")
@handle_errors
def cancel_all(config_file: Path, yes: bool) -> None:
    """Cancel every job of this service (its sandboxes go with them)."""
    from orchard_slurm.backend import SlurmBackend

    if not yes:
        click.confirm("Cancel every pilot of this service, and every sandbox on them?", abort=True)
    count = asyncio.run(SlurmBackend.from_settings(load_settings(config_file)).cancel_all())
    out.print(f"cancelled {count} job(s)")


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
def bench_slurm(settings_file: Optional[Path], runtime: str, mode: str, image: str, sandboxes: int, concurrency: int,
                samples: int, output: Optional[Path]) -> None:
    """Pilot start, sandbox ready on a warm pilot, exec round trip, N sandboxes end to end."""
    from orchard_slurm.bench import default_settings, measure

    settings = {**default_settings(runtime), "mode": mode}
    if settings_file is not None:
        settings.update(load_settings(settings_file))
    result = asyncio.run(measure(settings, image, sandboxes, samples, concurrency))
    report(result, f"orchard bench slurm --mode {settings['mode']} --runtime {settings['runtime']} -n {sandboxes}",
           output)
    if result["succeeded"] != sandboxes:
        raise SystemExit(1)
