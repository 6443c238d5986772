"""Fixtures of the interactive-process tests: the local agent and a sandbox on it."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def pty_agent(orchard_client):
    """(url, key, http client) of the local agent."""
    endpoint = orchard_client._portal.call(orchard_client._inner.backend.endpoint("any"))
    http = httpx.Client(transport=httpx.HTTPTransport(uds=endpoint.url.removeprefix("unix://")),
                        base_url="http://agent", headers={"X-API-Key": endpoint.token}, timeout=60)
    yield endpoint.url, endpoint.token, http
    http.close()


@pytest.fixture(scope="module")
def pty_sandbox(pty_agent, kit_image):
    url, key, http = pty_agent
    created = http.post("/sandboxes", json={"image": kit_image}).json()
    assert created["status"] == "ready", created
    yield created
    http.delete(f"/sandboxes/{created['sandbox_id']}")
