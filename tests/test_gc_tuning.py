"""The collector setting the agent and the server start with (``orchard.gc_tuning``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    """In a fresh interpreter: the setting is process-wide."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def test_startup_objects_are_frozen_and_young_collections_rarer():
    out = _run("""
        import gc
        from orchard.gc_tuning import YOUNG_THRESHOLD, tune_for_service
        import fastapi, pydantic  # a service's long-lived objects
        tune_for_service()
        print(gc.get_freeze_count() > 10_000, gc.get_threshold()[0] == YOUNG_THRESHOLD > 700)
    """)
    assert out.split() == ["True", "True"]


def test_garbage_cycles_are_still_collected():
    """Freezing and a larger young generation delay collection; they must not stop it: a
    service that makes cycles for ever keeps a bounded number of them."""
    out = _run("""
        import gc, weakref
        from orchard.gc_tuning import YOUNG_THRESHOLD, tune_for_service
        tune_for_service()

        class Node:
            pass

        alive = set()
        most = 0
        for i in range(20 * YOUNG_THRESHOLD):
            node = Node()
            node.self = node  # a cycle: only the collector frees it
            alive.add(i)
            weakref.finalize(node, alive.discard, i)
            del node
            most = max(most, len(alive))
        print(most <= 2 * YOUNG_THRESHOLD, len(alive) <= 2 * YOUNG_THRESHOLD)
    """)
    assert out.split() == ["True", "True"]
