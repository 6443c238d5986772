"""Slurm's own commands, asked directly: submitit waits forever for a job that vanished
when ``sacct`` is unavailable, so pilot states come from ``squeue`` (live jobs) and
``sacct`` (ended ones), each with a timeout, and a job neither knows counts as gone."""

from __future__ import annotations

import asyncio
import getpass
from typing import Iterable, Optional

from orchard.errors import BackendUnavailable

LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "RESIZING", "REQUEUED", "SUSPENDED"}  # COMPLETING: ending
COMMAND_TIMEOUT = 15.0


async def run(*argv: str, check: bool = True) -> str:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), COMMAND_TIMEOUT)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise BackendUnavailable(f"{argv[0]} did not answer within {COMMAND_TIMEOUT:.0f} s") from None
    if check and process.returncode != 0:
        raise BackendUnavailable(f"{' '.join(argv[:2])} failed: {err.decode(errors='replace').strip()}")
    return out.decode(errors="replace")


async def job_states(job_ids: Iterable[str]) -> dict[str, str]:
    """Slurm state of each job ("RUNNING", "CANCELLED", ...); "GONE" when Slurm forgot it."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    states = {job_id: "GONE" for job_id in ids}
    live = await run("squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(ids), check=False)  # -r: array tasks
    for line in live.splitlines():
        job_id, _, state = line.partition("|")
        if job_id in states:
            states[job_id] = state.strip()
    ended = [job_id for job_id, state in states.items() if state in ("GONE", "COMPLETING")]  # sacct: how it ended
    if ended:
        history = await run("sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(ended), check=False)
        for line in history.splitlines():
            job_id, _, state = line.partition("|")
            if job_id in states and state:
                states[job_id] = state.split()[0]  # "CANCELLED by 0" -> "CANCELLED"
    return states


async def node_failure(job_id: str) -> Optional[str]:
    """For a job that ended NODE_FAIL: its node, the node's state when asked (it may be back
    already) and the reason Slurm holds for it (an admin's or the controller's), e.g.
    "node n12, down* when checked, Slurm's reason: Not responding"."""
    nodes = (await run("sacct", "-n", "-P", "-X", "-o", "NodeList", "-j", job_id, check=False)).strip()
    if not nodes or nodes == "None assigned":
        return None
    state = (await run("sinfo", "-h", "-N", "-n", nodes, "-o", "%T|%E", check=False)).strip().splitlines()
    node_state, _, reason = (state[0] if state else "").partition("|")
    if not node_state:
        return f"node {nodes}"
    return f"node {nodes}, {node_state} when checked" + (f", Slurm's reason: {reason}" if reason and reason != "none" else "")


async def cancel(job_id: str) -> None:
    await run("scancel", job_id, check=False)


async def jobs_named(name: str, comment: str) -> dict[str, str]:
    """Live jobs of this user with this job name and comment (a service's pilots, known or
    not): job id -> state."""
    out = await run("squeue", "-h", "-r", "-u", getpass.getuser(), "-n", name, "-o", "%i|%T|%k")
    found = {}
    for line in out.splitlines():
        job_id, state, job_comment = (line.split("|", 2) + ["", ""])[:3]
        if job_comment.strip() == comment and state.strip() in LIVE_STATES:
            found[job_id.strip()] = state.strip()
    return found
