"""``orchard bench``: benchmark commands whose figures go into docs/benchmarks.md."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import click
from rich.table import Table

from orchard.cli.common import api_key_option, backend_option, handle_errors, out, url_option


@click.group()
def bench() -> None:
    """Benchmarks (results as a table and as JSON)."""


@bench.command("sandboxes")
@click.option("-n", "--sandboxes", type=int, default=100, show_default=True)
@click.option("-m", "--commands", type=int, default=1, show_default=True, help="commands per sandbox")
@click.option("-c", "--concurrency", type=int, default=32, show_default=True)
@click.option("--command", default="true", show_default=True)
@click.option("--image", default="host", show_default=True)
@click.option("--latency-samples", type=int, default=200, show_default=True,
              help="sequential execs in one sandbox after the load, for idle p50/p99")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@url_option
@api_key_option
@backend_option
@handle_errors
def sandboxes(sandboxes: int, commands: int, concurrency: int, command: str, image: str, latency_samples: int,
              output: Optional[Path], url: Optional[str], api_key: Optional[str], backend: str) -> None:
    """Create N sandboxes concurrently, run M commands in each, delete them."""
    from orchard.bench.sandboxes import run
    from orchard.client.aio import AsyncClient

    async def main() -> dict:
        async with AsyncClient(url, api_key, backend=None if url else backend) as client:
            return await run(client, sandboxes, commands, concurrency, command, image, latency_samples)

    result = asyncio.run(main())
    table = Table("metric", "value", title=f"orchard bench sandboxes -n {sandboxes} -m {commands} -c {concurrency}")
    for key, value in result.items():
        if key != "failures":
            table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    out.print(table)
    for failure in result["failures"]:
        out.print(f"[red]failure[/red] {failure}")
    if output:
        output.write_text(json.dumps(result, indent=2))
    if result["succeeded"] != sandboxes:
        raise SystemExit(1)
