"""``orchard serve``: the Orchard Env REST service."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from orchard.cli.common import api_key_options, handle_errors


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="YAML: host, port, api_key, state, backend {name, settings}, reconciler {...}")
@click.option("--backend", default=None, help="backend name (overrides the config)")
@click.option("--host", default=None)
@click.option("--port", type=int, default=None)
@api_key_options("X-API-Key callers must send")
@click.option("--state", type=click.Path(path_type=Path), default=None, help="SQLite file of the server's records")
@handle_errors
def serve(config_path: Optional[Path], backend: Optional[str], host: Optional[str], port: Optional[int],
          api_key: Optional[str], state: Optional[Path]) -> None:
    """Serve the Orchard Env API with the configured backend."""
    from orchard.server.config import load_config
    from orchard.server.main import serve as run

    config = load_config(config_path, {"backend": backend, "host": host, "port": port, "api_key": api_key,
                                       "state": state})
    run(config)
