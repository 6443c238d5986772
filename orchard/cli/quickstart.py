"""``orchard quickstart``: the README's first command ends here."""

from __future__ import annotations

import asyncio
import time

import click
from rich.table import Table

from orchard.cli.common import console, handle_errors, out


@click.command()
@click.option("--copies", type=int, default=2, show_default=True, help="sandboxes per project variant")
@handle_errors
def quickstart(copies: int) -> None:
    """Start sandboxes, run a small project's tests in each, show results, clean up."""
    from orchard.quickstart import run_quickstart

    console.print("[bold]orchard quickstart[/bold]: starting sandboxes on the local backend ...")
    start = time.perf_counter()
    results = asyncio.run(run_quickstart(copies))
    table = Table("sandbox", "implementation", "tests", "result", "network", "seconds")
    table.columns[0].no_wrap = True
    for r in results:
        table.add_row(r.sandbox_id, r.variant, "[green]pass[/green]" if r.passed else "[red]fail[/red]", r.summary,
                      "blocked" if r.network_blocked else "[red]open[/red]", f"{r.seconds:.2f}")
    out.print(table)
    passed = sum(r.passed for r in results)
    out.print(f"{len(results)} sandboxes, {passed} passed, {len(results) - passed} failed (the off-by-one "
              f"variant is meant to fail), all deleted; {time.perf_counter() - start:.2f}s in total")
