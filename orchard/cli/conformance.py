"""``orchard conformance NAME``: the whole backend conformance suite against one installed backend.

A thin spelling of ``pytest -p orchard.testing --orchard-backend NAME``: the suite is a
pytest plugin (``orchard.testing``), so a backend author can also run it from their own
test job. Extra arguments after ``--`` go to pytest (``-x``, ``-k exec``).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Optional

import click


def conformance_argv(name: str, config: Optional[str], image: Optional[str], unsupported: tuple[str, ...],
                     extra: tuple[str, ...]) -> list[str]:
    """The pytest command line the suite runs as (printed, so a CI job can copy it)."""
    argv = [sys.executable, "-m", "pytest", "-p", "orchard.testing", "--orchard-backend", name]
    if config:
        argv += ["--orchard-backend-config", config]
    if image:
        argv += ["--orchard-image", image]
    for limit in unsupported:
        argv += ["--orchard-unsupported", limit]
    return argv + list(extra)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.option("--config", "config", default=None, type=click.Path(exists=True, dir_okay=False),
              help="YAML/JSON file: {NAME: settings}")
@click.option("--image", default=None, help="the kit's image ('host' by default; a directory or docker:// reference)")
@click.option("--unsupported", multiple=True, metavar="LIMIT",
              help="a limit the backend declares it cannot enforce (memory, pids, cpu, disk); repeatable")
@click.argument("pytest_args", nargs=-1, type=click.UNPROCESSED)
def conformance(name: str, config: Optional[str], image: Optional[str], unsupported: tuple[str, ...],
                pytest_args: tuple[str, ...]) -> None:
    """Run the backend conformance suite against backend NAME (exit code: pytest's)."""
    from orchard.plugins import collect

    backends = collect("orchard_register_backends")
    if name not in backends:
        raise click.BadParameter(f"unknown backend {name!r}; installed: {', '.join(sorted(backends))}",
                                 param_hint="NAME")
    argv = conformance_argv(name, config, image, unsupported, pytest_args)
    click.echo("running: " + " ".join(argv[1:]), err=True)
    sys.exit(subprocess.call(argv))
