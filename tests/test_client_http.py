"""The SDK's HTTP client against real flaky servers on loopback: retries, backoff, types."""

from __future__ import annotations

import asyncio

import pytest

from orchard.client.http import ApiClient
from orchard.errors import AgentUnreachable, OrchardError, SandboxLost
from tests.images import free_port
from tests.json_server import JsonServer


class FlakyServer(JsonServer):
    """Answers 503 ``failures`` times, then 200; counts the calls it got."""

    def __init__(self, failures: int, final_status: int = 200, final_body: dict | None = None) -> None:
        self.calls = 0

        def answer(path: str, body: object) -> tuple[int, object]:
            self.calls += 1
            if self.calls <= failures:
                return 503, {"detail": "busy"}
            return final_status, final_body or {"ok": True}

        super().__init__(answer)


def call(client: ApiClient, **kwargs):
    async def run():
        try:
            return await client.request("POST", "/x", json_body={}, **kwargs)
        finally:
            await client.close()
    return asyncio.run(run())


def test_transient_503_is_retried_with_backoff():
    server = FlakyServer(failures=2)
    try:
        assert call(ApiClient(server.url, retries=5)) == {"ok": True}
        assert server.calls == 3
    finally:
        server.close()


def test_non_idempotent_calls_are_not_retried():
    server = FlakyServer(failures=2)
    try:
        with pytest.raises(AgentUnreachable):
            call(ApiClient(server.url, retries=5), idempotent=False)
        assert server.calls == 1
    finally:
        server.close()


def test_typed_errors_are_not_retried_and_keep_their_type():
    server = FlakyServer(failures=0, final_status=410,
                         final_body={"detail": "gone", "error": {"type": "SandboxLost", "message": "gone"}})
    try:
        with pytest.raises(SandboxLost, match="gone"):
            call(ApiClient(server.url, retries=5))
        assert server.calls == 1
    finally:
        server.close()


def test_connection_refused_is_retried_then_reported():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(AgentUnreachable, match="Cannot connect"):
        call(ApiClient(url, retries=2))


def test_deterministic_503s_are_not_retried_transient_ones_are():
    """Every 503 used to be retried: one bad create through the server started a sandbox up
    to 18 times. Errors now say whether they are worth retrying."""
    for retryable, expected_calls in ((False, 1), (True, 4)):
        body = {"detail": "x", "error": {"type": "RuntimeUnavailable" if not retryable else "AgentUnreachable",
                                         "message": "x", "retryable": retryable}}
        server = FlakyServer(failures=0, final_status=503, final_body=body)
        try:
            with pytest.raises(OrchardError):
                call(ApiClient(server.url, retries=3))
            assert server.calls == expected_calls, (retryable, server.calls)
        finally:
            server.close()


def test_the_sdk_chooses_sandbox_ids_so_a_retried_create_makes_one_sandbox():
    from orchard.client import Client

    bodies = []

    def answer(path: str, body: dict) -> tuple[int, dict]:
        bodies.append(body)
        if len(bodies) == 1:  # the first attempt's answer is lost on the way (a proxy says 503)
            return 503, {"detail": "upstream went away"}
        return 200, {"sandbox_id": body["sandbox_id"], "image": "host", "status": "ready", "ready": True}

    server = JsonServer(answer)
    try:
        with Client(server.url, "key") as client:
            sandbox = client.create("host")
        assert len(bodies) == 2 and bodies[0]["sandbox_id"] == bodies[1]["sandbox_id"] == sandbox.id
        assert sandbox.id.startswith("sbx-")
    finally:
        server.close()


def test_an_address_reused_by_a_new_agent_gets_a_client_with_the_new_key():
    """Per-job relays and pod IPs are reused by later agents with other keys: a client cached
    by address alone sent the old key (a per-job upload failed with 401)."""
    from orchard.client.aio import AsyncClient
    from orchard.backends.local.backend import LocalBackend, LocalBackendConfig

    client = AsyncClient(backend=LocalBackend(LocalBackendConfig()))
    first = client._agent_at("http://127.0.0.1:4242", "old-key")
    again = client._agent_at("http://127.0.0.1:4242", "old-key")
    fresh = client._agent_at("http://127.0.0.1:4242", "new-key")
    assert first is again and fresh is not first
