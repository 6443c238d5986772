"""``orchard sandbox create|exec|ls|rm`` against a server URL or in process."""

from __future__ import annotations

import sys
from typing import Optional

import click
from rich.table import Table

from orchard.cli.common import (
    api_key_option, backend_option, handle_errors, json_option, make_client, out, print_json, url_option,
)


@click.group()
def sandbox() -> None:
    """Create, use and delete sandboxes."""


@sandbox.command("create")
@click.option("--image", default="host", show_default=True, help="host, a rootfs directory, or docker://REF")
@click.option("--id", "sandbox_id", default=None, help="choose the sandbox id")
@click.option("--network/--no-network", default=False, help="allow network access (blocked by default)")
@click.option("--cpu", default=None)
@click.option("--memory", default=None)
@click.option("--disk", default=None)
@url_option
@api_key_option
@backend_option
@json_option
@handle_errors
def create(image: str, sandbox_id: Optional[str], network: bool, cpu: Optional[str], memory: Optional[str],
           disk: Optional[str], url: Optional[str], api_key: Optional[str], backend: str, as_json: bool) -> None:
    """Create a sandbox and print its id."""
    with make_client(url, api_key, backend) as client:
        handle = client.create(image, sandbox_id=sandbox_id, block_network=not network, cpu=cpu, memory=memory,
                               disk=disk)
        if as_json:
            print_json(handle.info.model_dump())
        else:
            click.echo(handle.id)


@sandbox.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True)
@click.option("--timeout", type=float, default=None)
@click.option("--cwd", default=None)
@click.option("--login", "login_shell", is_flag=True, help="run in a login shell that sources ~/.bashrc")
@url_option
@api_key_option
@backend_option
@json_option
@handle_errors
def exec_(sandbox_id: str, command: tuple[str, ...], timeout: Optional[float], cwd: Optional[str],
          login_shell: bool, url: Optional[str], api_key: Optional[str], backend: str, as_json: bool) -> None:
    """Run COMMAND in a sandbox; exits with the command's exit code."""
    text = command[0] if len(command) == 1 else list(command)
    with make_client(url, api_key, backend) as client:
        job = client.get(sandbox_id).exec(text, timeout=timeout, cwd=cwd, login_shell=login_shell)
    if as_json:
        print_json(job.model_dump())
    else:
        sys.stdout.write(job.stdout)
        sys.stderr.write(job.stderr)
    sys.exit(job.exit_code if job.exit_code is not None else 1)


@sandbox.command("ls")
@url_option
@api_key_option
@backend_option
@json_option
@handle_errors
def ls(url: Optional[str], api_key: Optional[str], backend: str, as_json: bool) -> None:
    """List sandboxes."""
    with make_client(url, api_key, backend) as client:
        sandboxes = client.list()
    if as_json:
        print_json([s.model_dump() for s in sandboxes])
        return
    table = Table("id", "status", "image", "network", "runtime")
    for s in sandboxes:
        table.add_row(s.sandbox_id, s.status, s.image, "blocked" if s.block_network else "open", s.runtime or "")
    out.print(table)


@sandbox.command("rm")
@click.argument("sandbox_ids", nargs=-1, required=True)
@url_option
@api_key_option
@backend_option
@handle_errors
def rm(sandbox_ids: tuple[str, ...], url: Optional[str], api_key: Optional[str], backend: str) -> None:
    """Delete sandboxes."""
    with make_client(url, api_key, backend) as client:
        for sandbox_id in sandbox_ids:
            client.delete(sandbox_id)
            click.echo(f"deleted {sandbox_id}")


@sandbox.command("shell")
@click.argument("sandbox_id")
@click.argument("command", nargs=-1)
@url_option
@api_key_option
@backend_option
@handle_errors
def shell(sandbox_id: str, command: tuple[str, ...], url: Optional[str], api_key: Optional[str], backend: str) -> None:
    """Open an interactive terminal in a sandbox (its shell, or COMMAND); exits with its code."""
    import asyncio

    from orchard.cli.shell import run_shell
    from orchard.client.aio import AsyncClient

    async def main() -> int:
        async with AsyncClient(url, api_key, backend=None if url else backend) as client:
            return await run_shell(client, sandbox_id, list(command) or None)

    sys.exit(asyncio.run(main()))
