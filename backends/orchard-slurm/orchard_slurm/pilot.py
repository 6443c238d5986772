"""What runs inside a pilot job: one exec agent on TCP that hosts many sandboxes.

Submitted by submitit (the service's Python, pickled): the compute node shares the
service's software stack and the shared directory. The agent writes its address into
``agent.json`` and its token (mode 0600) beside it in the pilot's directory; the
service reads both from there and talks to the node directly. Agent ports are reachable
cluster-wide, so every call needs a token (per-sandbox tokens for callers on the hot path).

Slurm sends SIGUSR2 ``stop_margin_seconds`` before the time limit (``--signal``), and on
preemption. submitit's own handler would requeue the job, which would bring back an empty
agent under the same job id; the pilot instead records why it stops (``stop.json``) and
shuts its agent down, which deletes every sandbox cleanly before Slurm kills anything.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Optional

STOP_RECORD = "stop.json"
GRACEFUL_SHUTDOWN_SECONDS = 10.0


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def write_stop_record(job_dir: Path, signum: int) -> None:
    record = {"signal": signal.Signals(signum).name, "time": time.time(),
              "reason": "Slurm's warning signal before the time limit (or preemption)"}
    (job_dir / STOP_RECORD).write_text(json.dumps(record))


def stop_before_time_limit(pilot_dir: Path) -> None:
    """On SIGUSR2: say why in ``stop.json``, then stop the agent as SIGTERM would."""

    def handle(signum: int, frame: object) -> None:
        write_stop_record(pilot_dir, signum)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGUSR2, handle)


def read_stop_record(pilot_dir: Path) -> Optional[dict]:
    try:
        return json.loads((pilot_dir / STOP_RECORD).read_text())
    except (OSError, ValueError):
        return None


IMAGE_POLICY_SETTINGS = ("registries", "insecure_registries", "image_digests", "signature_policy", "registries_d",
                         "image_dirs", "protected_dirs")  # SlurmConfig.image_policy() -> the pilot agent's settings


def run_pilot(state_dir: str, runtime: str, host: Optional[str], max_sandboxes: int, image_policy: dict,
              host_ids: tuple[int, int, int, int], memory_share: Optional[int] = None) -> None:
    """Serve an agent for this pilot; ``host_ids`` (first uid, first gid, block, blocks to
    search) says where it claims its block of sandbox host ids on this node; each sandbox's
    memory defaults to ``memory_share`` bytes, its share of the job's."""
    from orchard.agent.main import serve
    from orchard.agent.settings import AgentSettings

    host = host or socket.gethostname()
    settings = AgentSettings(state_dir=state_dir, runtime=runtime, max_sandboxes=max_sandboxes,
                             idle_exit_seconds=None,  # the pool decides when an idle pilot ends
                             cgroups_below_own=True,  # inside the job's cgroups: its limits bound the sandboxes
                             **({"default_memory": str(memory_share)} if memory_share else {}),
                             host_uid=host_ids[0], host_gid=host_ids[1], host_id_count=host_ids[2],
                             host_id_search=host_ids[3],
                             **{key: image_policy[key] for key in IMAGE_POLICY_SETTINGS
                                if image_policy.get(key) is not None})
    stop_before_time_limit(Path(state_dir))
    serve(settings, host=host, port=free_port(host), log_level="warning",
          graceful_shutdown_seconds=GRACEFUL_SHUTDOWN_SECONDS)
