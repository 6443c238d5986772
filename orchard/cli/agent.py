"""``orchard agent``: run, inspect or stop this machine's exec agent."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from orchard.cli.common import console, handle_errors, json_option, out, print_json


@click.group()
def agent() -> None:
    """The exec agent (the process that runs commands in sandboxes)."""


@agent.command("serve")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None)
@click.option("--runtime", default=None, help="bwrap (default), direct, or a plugin's runtime")
@click.option("--uds", type=click.Path(path_type=Path), default=None, help="listen on this Unix socket")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=0, help="listen on TCP (0: Unix socket in the state dir)")
@handle_errors
def serve(state_dir: Optional[Path], runtime: Optional[str], uds: Optional[Path], host: str, port: int) -> None:
    """Run an agent in the foreground."""
    from orchard.agent.main import serve as run
    from orchard.agent.settings import AgentSettings

    settings = AgentSettings(**{k: v for k, v in {"state_dir": state_dir, "runtime": runtime}.items() if v})
    run(settings, uds=uds, host=host, port=port, log_level="info")


@agent.command("status")
@json_option
@handle_errors
def status(as_json: bool) -> None:
    """The local agents running on this machine, and where."""
    from orchard.backends.local.launcher import running_agents

    agents = running_agents()
    if as_json:
        print_json(agents)
        return
    if not agents:
        out.print("no agent running")
    for info in agents:
        out.print(f"agent pid {info['pid']} at {info['address']} (runtime {info['runtime']}, "
                  f"state {info['state_dir']})")


@agent.command("stop")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="the agent of this state directory (default: the default one)")
@click.option("--all", "every", is_flag=True, help="every local agent on this machine")
@handle_errors
def stop(state_dir: Optional[Path], every: bool) -> None:
    """Stop local agents; their sandboxes are deleted."""
    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import running_agents, stop_agent

    dirs = [Path(info["state_dir"]) for info in running_agents()] if every else [state_dir]
    stopped = [d for d in dirs if stop_agent(AgentSettings(state_dir=d) if d else AgentSettings())]
    console.print(f"stopped {len(stopped)} agent(s)" if stopped else "no agent was running")


@agent.command("bundle")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True, help="where to build it")
@click.option("--force", is_flag=True, help="replace what is at --out")
@json_option
@handle_errors
def bundle(out_dir: Path, force: bool, as_json: bool) -> None:
    """Build a relocatable agent bundle (own Python and libc) for images without Python."""
    from orchard.bundle.build import build_bundle

    manifest = build_bundle(out_dir, force=force)
    if as_json:
        print_json({k: v for k, v in manifest.items() if k != "files"})
    else:
        out.print(f"bundle at {out_dir}: {manifest['size'] / 1e6:.1f} MB in {len(manifest['files'])} files, "
                  f"digest {manifest['digest'][:16]}; start it with {out_dir / 'bin' / 'orchard-agent'}")


@agent.command("verify-bundle")
@click.argument("bundle_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@handle_errors
def verify_bundle(bundle_dir: Path) -> None:
    """Check a bundle (say, an init container's copy) against its manifest."""
    from orchard.bundle.manifest import verify_bundle as verify

    manifest = verify(bundle_dir)
    out.print(f"bundle at {bundle_dir} is intact: digest {manifest['digest'][:16]}, {len(manifest['files'])} files")
