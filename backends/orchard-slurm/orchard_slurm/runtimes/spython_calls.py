"""The agent's calls into Apptainer, made through spython in a child process.

Run as ``python -m orchard_slurm.runtimes.spython_calls '{"op": ...}'``; prints one JSON
line. spython waits on its ``singularity`` children with ``subprocess``; the agent is a
child subreaper that reaps every child it has, which would take those exit statuses from
spython. In a process of its own, spython keeps its children to itself.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional


def client() -> Any:
    from spython.main import get_client

    return get_client(quiet=True)


def pull(reference: str, folder: str, name: str) -> dict[str, Any]:
    """``singularity pull`` into the SIF cache (once per reference; the caller checks the cache)."""
    path = client().pull(reference, pull_folder=folder, name=name, quiet=True)
    if not path or not Path(str(path)).exists():
        raise RuntimeError(f"pulling {reference} produced no image")
    return {"path": str(path)}


def start(image: str, name: str, options: list[str]) -> dict[str, Any]:
    """``singularity instance start OPTIONS IMAGE NAME``; spython then reads the instance's
    PID from ``instance list --json NAME``."""
    instance = client().instance(image, name=name, options=options, quiet=True)
    pid = getattr(instance, "pid", None)
    if not pid:
        raise RuntimeError(f"instance {name} did not start (apptainer's message is above)")
    return {"pid": int(pid)}


def stop(name: str) -> dict[str, Any]:
    """``singularity instance stop -t 5 NAME``."""
    sp = client()
    code = sp.instance(f"instance://{name}", name=name, start=False).stop(name=name, timeout=5)
    return {"return_code": code}


OPERATIONS = {"pull": pull, "start": start, "stop": stop}


def drop_to(ids: Optional[list[int]]) -> None:
    """Under a root agent, Apptainer runs as the unprivileged sandbox owner. Dropped here,
    after Python started, because the agent's interpreter may live where that uid cannot read."""
    if ids:
        importlib.import_module("spython.main")  # while we can still read it

        os.setgroups([])
        os.setgid(ids[1])
        os.setuid(ids[0])


def main() -> None:
    request = json.loads(sys.argv[1])
    drop_to(request.pop("as_ids", None))
    operation = OPERATIONS[request.pop("op")]
    try:
        print(json.dumps(operation(**request)))
    except Exception as exc:  # a clear line for the agent, which turns it into a typed error
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
