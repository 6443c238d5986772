"""The collector setting the agent and the server start with (``orchard.gc_tuning``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    """In a fresh interpreter: the setting is process-wide."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          check=True, timeout=120).stdout


def test_what_the_lifespan_built_is_frozen_once_the_server_has_started():
    """Tuned after the startup (the lifespan builds the service's long-lived state), not
    before it: that state is frozen too, and the young generation is collected less often."""
    out = _run("""
        import asyncio, gc, socket
        import uvicorn
        from orchard.gc_tuning import YOUNG_THRESHOLD, tune_after_startup

        state = {}

        async def app(scope, receive, send):
            if scope["type"] == "lifespan":
                await receive()
                state["long_lived"] = [[i] for i in range(50_000)]  # tracked objects, built at startup
                state["frozen_before"] = gc.get_freeze_count()
                await send({"type": "lifespan.startup.complete"})
                await receive()
                await send({"type": "lifespan.shutdown.complete"})

        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
        tune_after_startup(server)

        async def main():
            task = asyncio.create_task(server.serve(sockets=[listener]))
            while not server.started:
                await asyncio.sleep(0.01)
            state["frozen_after"] = gc.get_freeze_count()
            server.should_exit = True
            await task

        asyncio.run(main())
        print(state["frozen_before"] == 0, state["frozen_after"] >= 50_000, gc.get_threshold()[0] == YOUNG_THRESHOLD)
    """)
    assert out.split() == ["True", "True", "True"]


def test_garbage_cycles_are_still_collected_also_those_that_lived_a_while():
    """A larger young generation and frozen startup objects delay collection; they must not
    stop it: cycles that survive young collections (promoted to older generations) before
    they become garbage are freed too, so a service making them for ever keeps a bounded
    number. With the collector off the count reaches every cycle made (1,500,000)."""
    out = _run("""
        import collections, gc
        from orchard.gc_tuning import tune_for_service
        tune_for_service()

        live = 0
        most = 0

        class Node:
            def __init__(self):
                global live
                live += 1
                self.self = self  # a cycle: only the collector frees it

            def __del__(self):
                global live
                live -= 1

        window = collections.deque(maxlen=30_000)  # each lives past a young collection (20,000)
        for i in range(1_500_000):
            window.append(Node())
            if i % 1000 == 0:
                most = max(most, live)
        print(most)
    """)
    assert int(out) < 600_000


@pytest.mark.parametrize("service", ["agent", "server"])
def test_both_services_tune_after_their_startup(service, tmp_path, monkeypatch):
    """Wiring: `orchard serve` and the agent install the tuning on their uvicorn server."""
    import uvicorn

    tuned: list[object] = []

    def run(self) -> None:  # started, served nothing, stopped
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    if service == "agent":
        from orchard.agent import main
        from orchard.agent.settings import AgentSettings

        monkeypatch.setattr(main, "tune_after_startup", tuned.append)
        main.serve(AgentSettings(state_dir=str(tmp_path / "agent")), uds=tmp_path / "agent.sock")
    else:
        from orchard.server import main
        from orchard.server.config import load_config

        monkeypatch.setattr(main, "tune_after_startup", tuned.append)
        main.serve(load_config(None, {"backend": "local", "port": 0, "state": tmp_path / "server.db"}))
    assert len(tuned) == 1 and isinstance(tuned[0], uvicorn.Server)
