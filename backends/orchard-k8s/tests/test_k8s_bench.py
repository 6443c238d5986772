"""The CI size of ``orchard bench k8s``: 50 sandbox life cycles (create, one command, delete)
through a real ``orchard serve --backend k8s`` process against the Pod-API test double, which
counts every API request it is sent: at most 3 per life cycle, plus the one shared watch."""

from __future__ import annotations

import asyncio

from pod_api_server import KIT_IMAGE

from orchard_k8s.bench import measure
from orchard_k8s.watch import WATCH_SECONDS

SANDBOXES = 50


def test_fifty_life_cycles_cost_at_most_three_api_calls_each(pod_api, k8s_settings):
    calls, watches, lists = pod_api.pod_calls(), pod_api.watches, pod_api.requests[("LIST", "pods")]
    settings = {**k8s_settings, "namespace": "orchard-bench-ci"}
    result = asyncio.run(measure(settings, KIT_IMAGE, SANDBOXES, concurrency=10))
    assert result["succeeded"] == SANDBOXES, result["failures"]
    seen = pod_api.pod_calls() - calls
    assert seen / SANDBOXES <= 3, seen  # create the pod, create its key's Secret, delete the pod
    assert result["backend_api_calls"] == seen  # the backend's own count agrees with the server's
    assert pod_api.requests[("LIST", "pods")] - lists == 1  # one listing for the shared watch...
    renewals = int(result["wall_s"] // WATCH_SECONDS) + 1
    assert 1 <= pod_api.watches - watches <= 1 + renewals  # ...renewed when the server ends it, never per pod
    assert result["create_to_ready_p50_ms"] > 0
