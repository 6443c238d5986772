"""The shared pod watch's cache and waiters, driven by hand on one event loop (no thread,
no API server: the events are the ones the watch thread would post)."""

from __future__ import annotations

import asyncio

from orchard_k8s.watch import PodWatch


def pod(name: str, phase: str) -> dict:
    return {"metadata": {"name": name}, "status": {"phase": phase}}


def test_two_waiters_on_one_pod_each_wake_when_their_condition_holds():
    """One waiter leaving (its condition met) took the pod's shared wake-up event with it: a
    second waiter on the same pod then slept until its deadline (a create's whole start
    timeout) and raised TimeoutError, an untyped 500 from the server."""

    async def scenario() -> None:
        watch = PodWatch(None, "ns", "", asyncio.get_running_loop())  # type: ignore[arg-type]
        exists = asyncio.create_task(watch.wait_for("p", lambda p: p is not None, 5))
        running = asyncio.create_task(
            watch.wait_for("p", lambda p: (p or {}).get("status", {}).get("phase") == "Running", 5))
        await asyncio.sleep(0)
        watch._apply("ADDED", pod("p", "Pending"))
        assert (await exists)["status"]["phase"] == "Pending"
        watch._apply("MODIFIED", pod("p", "Running"))
        assert (await asyncio.wait_for(running, 1))["status"]["phase"] == "Running"
        assert watch._waiters == {}

    asyncio.run(scenario())
