"""``orchard``: backends, sandboxes, the agent, benchmarks and the quickstart."""

from __future__ import annotations

import click
from rich.table import Table

from orchard import __version__
from orchard.cli.common import PluginGroup, handle_errors, json_option, out, print_json
from orchard.cli.agent import agent
from orchard.cli.bench import bench
from orchard.cli.credit import credit
from orchard.cli.train import train
from orchard.cli.launch import launch
from orchard.cli.sandbox import sandbox
from orchard.cli.quickstart import quickstart
from orchard.cli.serve import serve
from orchard.cli.tasks import tasks
from orchard.cli.eval import evaluate
from orchard.cli.pipeline import pipeline
from orchard.cli.doctor import doctor
from orchard.cli.conformance import conformance


@click.group(cls=PluginGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="orchard")
def cli() -> None:
    """Orchard: sandboxes for training language-model agents."""


@cli.command()
@json_option
@handle_errors
def backends(as_json: bool) -> None:
    """List installed sandbox backends: name, distribution, version, availability."""
    from orchard.plugins import collect, distribution_of

    rows = []
    for name, cls in sorted(collect("orchard_register_backends").items()):
        dist, version = distribution_of(cls)
        reason = cls.unavailable_reason()
        rows.append({"name": name, "distribution": dist, "version": version, "available": reason is None,
                     "reason": reason})
    if as_json:
        print_json(rows)
        return
    table = Table("backend", "distribution", "version", "available")
    for row in rows:
        table.add_row(row["name"], row["distribution"], row["version"],
                      "[green]yes[/green]" if row["available"] else f"[red]no[/red]: {row['reason']}")
    out.print(table)


cli.add_command(sandbox)
cli.add_command(agent)
cli.add_command(bench)
cli.add_command(quickstart)
cli.add_command(serve)
cli.add_command(credit)
cli.add_command(train)
cli.add_command(launch)
cli.add_command(tasks)
cli.add_command(evaluate)
cli.add_command(pipeline)
cli.add_command(doctor)
cli.add_command(conformance)


def main() -> None:
    cli()
