"""What runs inside a pilot job: one exec agent on TCP that hosts many sandboxes.

Submitted by submitit (the service's Python, pickled): the compute node shares the
service's software stack and the shared directory. The agent writes its address into
``agent.json`` and its token (mode 0600) beside it in the pilot's directory; the
service reads both from there and talks to the node directly. Agent ports are reachable
cluster-wide, so every call needs a token (per-sandbox tokens for callers on the hot path).
"""

from __future__ import annotations

import socket
from typing import Optional


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def run_pilot(state_dir: str, runtime: str, host: Optional[str], max_sandboxes: int) -> None:
    from orchard.agent.main import serve
    from orchard.agent.settings import AgentSettings

    host = host or socket.gethostname()
    settings = AgentSettings(state_dir=state_dir, runtime=runtime, max_sandboxes=max_sandboxes)
    serve(settings, host=host, port=free_port(host), log_level="warning")
