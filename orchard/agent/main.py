"""Run an exec agent: ``orchard agent serve`` (or ``python -m orchard.agent``).

The agent is its own process, never a thread of a server, so a server crash or
restart does not take sandboxes or running commands with it. On start it writes
``agent.json`` (pid, address) into its private state directory; its token lives
beside it with mode 0600.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Optional

import uvicorn

from orchard import __version__
from orchard.agent.app import create_app
from orchard.agent.environment import restore
from orchard.agent.service import AgentService
from orchard.agent.settings import AgentSettings
from orchard.agent.state_lock import hold_state_dir
from orchard.download_cut import quiet_download_cuts
from orchard.gc_tuning import tune_after_startup


def load_or_create_token(settings: AgentSettings) -> str:
    token = os.environ.get("ORCHARD_AGENT_TOKEN")
    if token:
        return token
    path = settings.agent_dir / "token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    return token


def event_loop() -> str:
    """uvloop where the reaper can watch children through pidfds (uvloop keeps SIGCHLD for
    itself; see reaper.py), else asyncio's."""
    try:
        import uvloop  # noqa: F401

        os.close(os.pidfd_open(os.getpid()))
    except (ImportError, AttributeError, OSError):
        return "asyncio"
    return "uvloop"


def serve(settings: AgentSettings, uds: Optional[Path] = None, host: str = "127.0.0.1", port: int = 0,
          log_level: str = "warning", graceful_shutdown_seconds: Optional[float] = None,
          fd: Optional[int] = None) -> None:
    """Run the agent until SIGTERM/SIGINT; on the way out it deletes its sandboxes
    (waiting at most ``graceful_shutdown_seconds`` for requests in flight). ``fd``: a
    listening socket handed over by whoever started us (a per-job Slurm job), so no socket
    path exists where the sandbox could replace it."""
    settings.make_dirs()
    state_lock = hold_state_dir(settings)  # before touching its socket, token or sandboxes
    if settings.runtime == "direct":  # commands run as we do: they must not ptrace us or take our fds
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    if fd is not None:
        os.set_inheritable(fd, False)  # the listening socket stays ours, never a command's
    token = load_or_create_token(settings)
    service = AgentService(settings)
    app = create_app(service, token)
    if uds is None and port == 0 and fd is None:
        uds = settings.agent_dir / "agent.sock"
    if uds is not None and uds.exists():
        uds.unlink()
    config = uvicorn.Config(app, uds=str(uds) if uds else None, host=host, port=port, log_level=log_level,
                            access_log=False, proxy_headers=False, lifespan="on", loop=event_loop(),
                            timeout_keep_alive=60, backlog=4096,
                            timeout_graceful_shutdown=graceful_shutdown_seconds, fd=fd,
                            limit_concurrency=settings.max_connections)
    server = uvicorn.Server(config)
    quiet_download_cuts()
    address = f"fd://{fd}" if fd is not None else f"unix://{uds}" if uds else f"http://{host}:{port}"
    info_path = settings.agent_dir / "agent.json"

    original_startup = server.startup

    async def startup(sockets=None) -> None:
        await original_startup(sockets)
        if server.started:
            if uds is not None:
                os.chmod(uds, 0o600)
            staging = info_path.with_name("agent.json.partial")  # readers poll for the file: whole or not at all
            staging.write_text(json.dumps({"pid": os.getpid(), "address": address, "runtime": settings.runtime,
                                           "version": __version__}))
            os.replace(staging, info_path)

    original_shutdown = server.shutdown

    async def shutdown(sockets=None) -> None:
        try:
            await original_shutdown(sockets)  # the lifespan's end: the sandboxes are deleted
        finally:
            info_path.unlink(missing_ok=True)  # here: after it, uvicorn re-raises SIGTERM, and no finally runs

    server.startup = startup  # type: ignore[method-assign]
    server.shutdown = shutdown  # type: ignore[method-assign]
    tune_after_startup(server)
    try:
        server.run()
    finally:
        info_path.unlink(missing_ok=True)
        os.close(state_lock)  # the kernel drops it anyway when the process ends, however it ends


def main() -> None:
    parser = argparse.ArgumentParser(prog="orchard-agent", description=__doc__)
    parser.add_argument("--state-dir", type=Path)
    parser.add_argument("--runtime")
    parser.add_argument("--uds", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--fd", type=int, help="serve on this inherited listening socket")
    parser.add_argument("--settings-json", help="AgentSettings as JSON")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--restore-env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="put a variable back as it was before the bundle launcher started Python")
    parser.add_argument("--version", action="version", version=f"orchard-agent {__version__}")
    args = parser.parse_args()
    restore(args.restore_env)
    data = json.loads(args.settings_json) if args.settings_json else {}
    if args.state_dir:
        data["state_dir"] = str(args.state_dir)
    if args.runtime:
        data["runtime"] = args.runtime
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(AgentSettings(**data), uds=args.uds, host=args.host, port=args.port, log_level=args.log_level, fd=args.fd)


if __name__ == "__main__":
    main()
