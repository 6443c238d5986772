"""The SDK's HTTP client against real flaky servers on loopback: retries, backoff, types."""

from __future__ import annotations

import asyncio

import pytest

from orchard.client.http import ApiClient
from orchard.errors import AgentUnreachable, SandboxLost
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
