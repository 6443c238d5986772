"""The adapters under test (mini-swe-agent's environment, SWE-ReX's deployment) open an
Orchard client with default settings, which joins the session's shared agent or starts it.
Started with defaults, that agent would refuse the suite's directory images (they live in
/tmp, outside its image directories) for every later test: so it is started here first, with
the suite's settings, whatever order the tests run in."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def shared_agent_with_suite_settings(orchard_backend_settings):
    from orchard.client import Client

    with Client(backend="local", backend_settings=orchard_backend_settings["local"]) as client:
        client.list()  # starts the agent now
    yield
