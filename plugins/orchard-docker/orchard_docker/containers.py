"""What the backend asks the engine for, as plain values: a sandbox's container name, labels
and create options, and how to read a container's state (ready, gone, and why).

The container runs the agent bundle's launcher as its only process (``--runtime direct``:
the container *is* the sandbox). Its host mounts are exactly two: the bundle, read-only, and
the sandbox's control directory (the agent's Unix socket; see ``control.py``), plus its key
file, read-only. No privilege, every capability dropped (the direct runtime needs none: it
runs commands as the agent's own user through ``orchard-enter``, which only lowers what it
has), ``no-new-privileges``, the engine's default seccomp profile, a private IPC namespace,
no restart: a sandbox that dies is lost, never silently restarted empty.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from orchard.models import SandboxSpec
from orchard.quantities import parse_cpu, parse_disk, parse_memory

MANAGED_LABEL = "orchard.managed-by"
INSTANCE_LABEL = "orchard.instance"
SANDBOX_LABEL = "orchard.sandbox-id"
SPEC_LABEL = "orchard.spec"
LIMIT_FIELDS = ("image", "cpu", "memory", "disk", "pids", "block_network")  # what the container is made with

BUNDLE_TARGET = "/opt/orchard"
CONTROL_TARGET = "/run/orchard"
AGENT_STATE = "/tmp/.orchard-agent"
KEY_TARGET = f"{AGENT_STATE}/agent/token"  # where the agent looks for its key when no variable carries it
AGENT_SOCKET = f"{CONTROL_TARGET}/agent.sock"
AGENT_ARGV = [f"{BUNDLE_TARGET}/bin/orchard-agent", "--runtime", "direct", "--state-dir", AGENT_STATE,
              "--uds", AGENT_SOCKET, "--settings-json", json.dumps({"idle_exit_seconds": None})]


def container_name(instance: str, sandbox_id: str) -> str:
    """Sandbox ids already use Docker's name alphabet ([A-Za-z0-9][A-Za-z0-9_.-]*); the hash keeps
    ids that differ only in case apart on engines that compare names without it."""
    return f"orchard-{instance}-{sandbox_id}-{hashlib.sha256(sandbox_id.encode()).hexdigest()[:6]}"


def selector(instance: str) -> dict[str, list[str]]:
    """The engine's label filter for this server's sandbox containers."""
    return {"label": [f"{MANAGED_LABEL}=orchard", f"{INSTANCE_LABEL}={instance}"]}


def limits_of(spec: SandboxSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in LIMIT_FIELDS}


def labels(spec: SandboxSpec, instance: str) -> dict[str, str]:
    """No secret here: the key lives in the control directory only; env and the caller's labels
    stay with the agent."""
    return {MANAGED_LABEL: "orchard", INSTANCE_LABEL: instance, SANDBOX_LABEL: str(spec.sandbox_id),
            SPEC_LABEL: json.dumps(limits_of(spec), sort_keys=True)}


def spec_of(container_labels: dict[str, str]) -> dict[str, Any]:
    """The limits a container was made with (from its label), empty if unreadable."""
    try:
        found = json.loads(container_labels.get(SPEC_LABEL, ""))
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def host_options(spec: SandboxSpec, *, bundle: str, control: str, key: str, network: str,
                 pids: Optional[int], ulimits: dict[str, int], runtime: Optional[str]) -> dict[str, Any]:
    """Keyword arguments of ``docker.APIClient.create_host_config`` (see the module docstring)."""
    from docker.types import Mount, Ulimit

    options: dict[str, Any] = {
        "mounts": [Mount(BUNDLE_TARGET, bundle, type="bind", read_only=True),
                   Mount(CONTROL_TARGET, control, type="bind", read_only=False),
                   Mount(KEY_TARGET, key, type="bind", read_only=True)],
        "network_mode": "none" if spec.block_network else network,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
        "ipc_mode": "private",
        "restart_policy": {"Name": "no"},
        "ulimits": [Ulimit(name=name, soft=value, hard=value) for name, value in sorted(ulimits.items())],
    }
    if spec.memory:
        options["mem_limit"] = options["memswap_limit"] = parse_memory(spec.memory)  # no swap beyond it
    if spec.cpu:
        options["nano_cpus"] = int(parse_cpu(spec.cpu) * 1e9)
    if pids:
        options["pids_limit"] = pids
    if spec.disk:
        options["storage_opt"] = {"size": str(parse_disk(spec.disk))}
    if runtime:
        options["runtime"] = runtime
    return options


def image_reference(image: str) -> str:
    """The engine's name of a ``docker://`` image (the scheme is optional)."""
    return image.removeprefix("docker://")


def is_running(attrs: dict[str, Any]) -> bool:
    return (attrs.get("State") or {}).get("Status") == "running"


def lost_reason(attrs: Optional[dict[str, Any]]) -> Optional[str]:
    """Why a container no longer serves its sandbox (OOM-killed, exited, removed); None while
    it runs or is still being created."""
    if attrs is None:
        return "its container was removed"
    state = attrs.get("State") or {}
    status = state.get("Status")
    if status in ("running", "created", "configured", "initialized", "paused"):
        return None
    if state.get("OOMKilled"):
        return f"its container was OOM-killed (memory limit reached; exit code {state.get('ExitCode')})"
    said = f": {state['Error']}" if state.get("Error") else ""
    return f"its container is {status or 'gone'} (exit code {state.get('ExitCode')}){said}"
