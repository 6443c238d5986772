"""``orchard bench compare``: Orchard and SWE-ReX side by side, in one run.

The same workload against each target: create N sandboxes (SWE-ReX: N bash sessions; it
has no sandboxes), run ``true`` and a small Python command M times each, spread over the
sandboxes, then tear down. Targets:

- ``orchard``: the SDK in process -> the local agent (isolated: namespaces, no capabilities,
  cgroup limits, seccomp);
- ``orchard-server``: the SDK -> ``orchard serve`` (started here, on loopback) -> the same agent;
- ``swerex-local``: SWE-ReX's ``LocalRuntime`` in process (``subprocess.run``, no isolation);
- ``swerex-remote``: SWE-ReX's ``RemoteRuntime`` -> ``swerex-remote`` (started here, on
  loopback; no isolation), ``execute(shell=True)``: ``/bin/sh -c CMD`` (dash on Debian);
- ``swerex-remote-bash``: the same, running ``bash -c CMD``, the command line Orchard runs
  (its contract is bash): the frameworks compared with the program held equal;
- ``swerex-remote-session``: the same server, ``run_in_session`` on a persistent bash
  (SWE-agent's way: no process per command, output read back through pexpect).

Commands are sent in rounds (``--chunk`` commands of one target, then the next target), so
a background load that comes and goes weighs on every target alike; ratios come from the
same run. Latency is the caller's: from the call to its result.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional


from orchard.agent.runtimes.api import DEFAULT_PATH
from orchard.bench.measure import cpu_probe, cpu_seconds_fine, own_cpu_seconds, percentile
from orchard.bench.serve_process import ServeProcess, free_port

TRUE_COMMAND = "true"
PYTHON_COMMAND = "python3 -c 'print(sum(range(1000)))'"
SWEREX_REMOTE_WAYS = {"swerex-remote": "shell", "swerex-remote-bash": "bash", "swerex-remote-session": "session"}
TARGETS = ("orchard", "orchard-direct", "orchard-server", "swerex-local", *SWEREX_REMOTE_WAYS)
REFERENCE = "swerex-remote"  # the peer; ratios to the other remote ways are reported beside it


class Target:
    """One way of running commands: set up N places to run them, run one, tear down."""

    name = ""

    def server_pid(self) -> Optional[int]:
        """The process that serves this target's commands (for its CPU time), if any."""
        return None

    async def setup(self, count: int) -> None: ...

    async def run(self, index: int, command: str) -> None: ...

    async def teardown(self) -> None: ...


class OrchardTarget(Target):
    """``orchard``: the SDK in process with the local backend; ``orchard-server``: through
    ``orchard serve``; ``orchard-direct``: sandboxes made through the server, commands sent
    straight to their agent (the SDK's ``direct=True``, a trainer's hot path)."""

    def __init__(self, name: str, url: Optional[str], api_key: Optional[str], agent: dict[str, Any], image: str,
                 direct: bool = False) -> None:
        self.name, self.url, self.api_key, self.agent, self.image = name, url, api_key, agent, image
        self.direct = direct
        self.client: Any = None
        self.sandboxes: list[Any] = []

    async def setup(self, count: int) -> None:
        from orchard.client.aio import AsyncClient

        if self.url:
            self.client = AsyncClient(self.url, self.api_key, direct=self.direct)
        else:
            self.client = AsyncClient(backend="local", backend_settings={"agent": self.agent})
        await self.client.__aenter__()
        self.sandboxes = list(await asyncio.gather(*(self.client.create(self.image) for _ in range(count))))

    def server_pid(self) -> Optional[int]:
        import json

        try:  # the agent: the in-process SDK's and the server's
            return int(json.loads((Path(self.agent["state_dir"]) / "agent" / "agent.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    async def run(self, index: int, command: str) -> None:
        job = await self.sandboxes[index].exec(command)
        if job.exit_code != 0:
            raise RuntimeError(f"{self.name}: {command!r} exited {job.exit_code}: {job.stderr[-300:]}")

    async def teardown(self) -> None:
        await asyncio.gather(*(sandbox.delete() for sandbox in self.sandboxes))
        await self.client.close()


class SwerexTarget(Target):
    """``way``: "shell" (``sh -c``), "bash" (``bash -c``) or "session" (a persistent bash)."""

    def __init__(self, name: str, remote: bool, way: str = "shell") -> None:
        self.name, self.remote, self.way = name, remote, way
        self.runtime: Any = None
        self.server: Optional[subprocess.Popen] = None
        self.sessions: list[str] = []
        self.env = {"PATH": DEFAULT_PATH, "HOME": os.environ.get("HOME", "/root")}  # what the `host` image gives

    async def setup(self, count: int) -> None:
        from swerex.runtime.abstract import CreateBashSessionRequest

        if self.remote:
            from swerex.runtime.remote import RemoteRuntime

            port, token = free_port(), secrets.token_hex(8)
            self.server = subprocess.Popen(
                [sys.executable, "-c", "from swerex.server import main; main()", "--host", "127.0.0.1", "--port",
                 str(port), "--auth-token", token], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.runtime = RemoteRuntime(host="http://127.0.0.1", port=port, auth_token=token)
            await self.runtime.wait_until_alive(timeout=60)
        else:
            from swerex.runtime.local import LocalRuntime

            self.runtime = LocalRuntime()
        self.sessions = [f"s{k}" for k in range(count)]
        await asyncio.gather(*(self.runtime.create_session(CreateBashSessionRequest(session=name))
                               for name in self.sessions))
        if self.way == "session":
            from swerex.runtime.abstract import BashAction

            for name in self.sessions:
                await self.runtime.run_in_session(BashAction(command=f"export PATH={self.env['PATH']}", session=name))

    def server_pid(self) -> Optional[int]:
        return self.server.pid if self.server is not None else None

    async def call(self, index: int, command: str) -> Any:
        """SWE-ReX's answer to ``command`` run this target's way in session ``index``."""
        from swerex.runtime.abstract import BashAction, Command

        if self.way == "session":  # state persists; the session's PATH was exported at setup
            return await self.runtime.run_in_session(
                BashAction(command=command, session=self.sessions[index], check="silent", timeout=60))
        # the sandbox's PATH: `python3` is then the same binary on both sides (a PATH with a
        # pyenv shim first made SWE-ReX's Python command 110 ms instead of 15)
        argv: Any = ["bash", "-c", command] if self.way == "bash" else command
        return await self.runtime.execute(Command(command=argv, shell=self.way == "shell", env=self.env))

    async def run(self, index: int, command: str) -> None:
        response = await self.call(index, command)
        if response.exit_code != 0:
            said = getattr(response, "stderr", None) or getattr(response, "output", "")  # a session has one stream
            raise RuntimeError(f"{self.name}: {command!r} exited {response.exit_code}: {said[-300:]}")

    async def teardown(self) -> None:
        from swerex.runtime.abstract import CloseBashSessionRequest

        await asyncio.gather(*(self.runtime.close_session(CloseBashSessionRequest(session=name))
                               for name in self.sessions))
        await self.runtime.close()
        if self.server is not None:
            self.server.terminate()
            self.server.wait(10)


def _summary(latencies: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(latencies, 50), 3), "p99_ms": round(percentile(latencies, 99), 3),
            "n": len(latencies)}


async def run(targets: list[str], sandboxes: int, commands: int, python_commands: int, chunk: int, image: str,
              spawner: bool, state_dir: Optional[Path]) -> dict[str, Any]:
    """The comparison; the figures of each target and the ratios to SWE-ReX remote's."""
    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import stop_agent

    work = Path(tempfile.mkdtemp(prefix="orchard-compare-"))
    os.chmod(work, 0o711)  # sandbox roots below it must be reachable by the sandbox uid
    state = state_dir or work / "state"
    agent = {"state_dir": str(state), "spawner": spawner, "idle_exit_seconds": 300}
    server: Optional[ServeProcess] = None
    chosen: list[Target] = []
    for name in targets:
        if name == "orchard":
            chosen.append(OrchardTarget(name, None, None, agent, image))
        elif name in ("orchard-server", "orchard-direct"):
            server = server or ServeProcess({"name": "local", "settings": {"agent": agent}}, work)
            chosen.append(OrchardTarget(name, server.url, server.api_key, agent, image, direct=name == "orchard-direct"))
        elif name == "swerex-local":
            chosen.append(SwerexTarget(name, remote=False))
        elif name in SWEREX_REMOTE_WAYS:
            chosen.append(SwerexTarget(name, remote=True, way=SWEREX_REMOTE_WAYS[name]))
        else:
            raise ValueError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
    results: dict[str, Any] = {}
    lat: dict[str, dict[str, list[float]]] = {t.name: {"true": [], "python": []} for t in chosen}
    busy = {t.name: 0.0 for t in chosen}
    cpu = {t.name: [0.0, 0.0] for t in chosen}  # this process (the client), the serving process
    try:
        if server is not None:
            await server.wait_ready()
        for target in chosen:
            started = time.perf_counter()
            await target.setup(sandboxes)
            results[target.name] = {"setup_s": round(time.perf_counter() - started, 3)}
            for k in range(sandboxes):  # warm-up: one of each command per sandbox, not counted
                await target.run(k, TRUE_COMMAND)
                await target.run(k, PYTHON_COMMAND)
        plan = [("true", TRUE_COMMAND)] * commands + [("python", PYTHON_COMMAND)] * python_commands
        load_before, probe_before = os.getloadavg(), cpu_probe()
        for round_index, start in enumerate(range(0, len(plan), chunk)):
            first = round_index % len(chosen)  # each target opens as many rounds: the opener finds caches cold
            for target in chosen[first:] + chosen[:first]:
                pid = target.server_pid()
                client_cpu, server_cpu = own_cpu_seconds(), cpu_seconds_fine(pid) if pid else 0.0
                for offset, (kind, command) in enumerate(plan[start:start + chunk]):
                    began = time.perf_counter()
                    await target.run((start + offset) % sandboxes, command)
                    spent = time.perf_counter() - began
                    lat[target.name][kind].append(spent * 1000)
                    busy[target.name] += spent
                cpu[target.name][0] += own_cpu_seconds() - client_cpu
                cpu[target.name][1] += (cpu_seconds_fine(pid) if pid else 0.0) - server_cpu
        load_after = os.getloadavg()
        for target in chosen:
            started = time.perf_counter()
            await target.teardown()
            results[target.name]["teardown_s"] = round(time.perf_counter() - started, 3)
    finally:
        if server is not None:
            server.stop()
        stop_agent(AgentSettings(state_dir=state))
        shutil.rmtree(work, ignore_errors=True)
    for target in chosen:
        entry = results[target.name]
        entry["true"] = _summary(lat[target.name]["true"])
        entry["python"] = _summary(lat[target.name]["python"])
        entry["commands_per_s"] = round(len(plan) / busy[target.name], 1) if busy[target.name] else 0.0
        entry["cpu_ms_per_command"] = {"client": round(cpu[target.name][0] * 1000 / len(plan), 3),
                                       "server": round(cpu[target.name][1] * 1000 / len(plan), 3)}
    for name in SWEREX_REMOTE_WAYS:
        reference = results.get(name)
        if reference is not None:
            results[f"ratio_to_{name.replace('-', '_')}"] = {
                t.name: {kind: round(results[t.name][kind]["p50_ms"] / reference[kind]["p50_ms"], 3)
                         for kind in ("true", "python") if reference[kind]["p50_ms"]}
                for t in chosen if t.name != name and (name == REFERENCE or t.name.startswith("orchard"))}
    results["load_average"] = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]}
    results["cpu_probe_s"] = {"before": probe_before, "after": cpu_probe()}  # the machine's speed: see measure.cpu_probe
    results["spawner"] = spawner
    return results
