"""Shared CLI plumbing: client construction, JSON output, typed errors to exit codes."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import click
from rich.console import Console

from orchard.errors import OrchardError

console = Console(stderr=True)
out = Console()

url_option = click.option("--url", envvar="ORCHARD_URL", default=None,
                          help="Orchard Env server or agent URL (http://..., unix:///...); in-process if unset.")


def _remember_key_file(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> None:
    if value is not None:
        key = Path(value).read_text().strip()
        if not key:
            raise click.BadParameter(f"{value} is empty", param=param)
        ctx.meta["orchard.api_key_file"] = key


def _key_or_file(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[str]:
    from_file = ctx.meta.get("orchard.api_key_file")
    if value is not None and from_file is not None:
        raise click.UsageError("give the API key once: --api-key (ORCHARD_API_KEY) or --api-key-file")
    return value if value is not None else from_file


def api_key_options(help_text: str) -> Callable[[Callable], Callable]:
    """``--api-key`` (ORCHARD_API_KEY) or ``--api-key-file`` (ORCHARD_API_KEY_FILE): a key in argv
    is visible to every user in ``ps``, so scripts should prefer the variable or the file."""
    def decorate(func: Callable) -> Callable:
        func = click.option("--api-key", envvar="ORCHARD_API_KEY", default=None, callback=_key_or_file,
                            help=f"{help_text} (visible in ps: prefer ORCHARD_API_KEY or --api-key-file)")(func)
        return click.option("--api-key-file", envvar="ORCHARD_API_KEY_FILE", default=None, expose_value=False,
                            is_eager=True, callback=_remember_key_file,
                            type=click.Path(exists=True, dir_okay=False), help="file holding the API key")(func)
    return decorate


api_key_option = api_key_options("X-API-Key for --url")
backend_option = click.option("--backend", envvar="ORCHARD_BACKEND", default="local", show_default=True,
                              help="Backend for in-process mode.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


class PluginGroup(click.Group):
    """A group that asks plugins for their commands (hook ``orchard_add_commands``) only when
    a name is not built in, or when every name is listed: a built-in command loads no plugin."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        command = super().get_command(ctx, cmd_name)
        if command is None and load_plugin_commands(ctx):
            command = super().get_command(ctx, cmd_name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        load_plugin_commands(ctx)
        return super().list_commands(ctx)


def load_plugin_commands(ctx: click.Context) -> bool:
    """Let every plugin add its commands to the root group, once; False if already done."""
    root = ctx.find_root().command
    if getattr(root, "plugins_loaded", False):
        return False
    root.plugins_loaded = True  # type: ignore[attr-defined]
    from orchard.plugins import get_plugin_manager

    get_plugin_manager().hook.orchard_add_commands(cli=root)
    return True


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def make_client(url: Optional[str], api_key: Optional[str], backend: str = "local"):
    from orchard.client import Client

    return Client(url, api_key) if url else Client(backend=backend)


def handle_errors(func: Callable) -> Callable:
    """Typed errors become one clear line on stderr and a non-zero exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except OrchardError as exc:
            console.print(f"[red]error[/red] ({type(exc).__name__}): {exc.message}")
            sys.exit(2)

    return wrapper
