"""The kit itself: a backend that breaks a promise fails it (the isolation tests are not
vacuous). Each broken backend here is the local backend with one promise dropped."""

from __future__ import annotations

import pytest

from orchard.backends.local.backend import LocalBackend, LocalBackendConfig
from orchard.client import Client
from orchard.models import Sandbox, SandboxSpec
from orchard.testing import isolation
from orchard.testing.isolation import host_listener  # noqa: F401  (a fixture)


class NetworkIgnoringBackend(LocalBackend):
    """Gives every sandbox the network, whatever it asked for."""

    async def create(self, spec: SandboxSpec) -> Sandbox:
        return await super().create(spec.model_copy(update={"block_network": False}))


class LimitIgnoringBackend(LocalBackend):
    """Drops the sandbox's own memory, pids and CPU limits (the agent's defaults remain)."""

    async def create(self, spec: SandboxSpec) -> Sandbox:
        return await super().create(spec.model_copy(update={"memory": None, "pids": None, "cpu": None}))


def broken_client(cls: type[LocalBackend], agent_settings) -> Client:
    return Client(backend=cls(LocalBackendConfig(agent=agent_settings)))


def test_a_backend_that_ignores_block_network_fails_the_kit(agent_settings, host_listener):  # noqa: F811
    with broken_client(NetworkIgnoringBackend, agent_settings) as client:
        with pytest.raises(AssertionError):
            isolation.test_a_blocked_sandbox_reaches_no_network_not_even_host_loopback(client, host_listener, "host")


# (The CPU check bounds use from above only: against an unlimited sandbox it passes when the
# machine is too busy to give a core, so it is not used here to prove the kit fails.)
@pytest.mark.parametrize("check", [isolation.test_memory_limit_is_enforced, isolation.test_pids_limit_is_enforced])
def test_a_backend_that_ignores_limits_fails_the_kit(agent_settings, check):
    with broken_client(LimitIgnoringBackend, agent_settings) as client:
        with pytest.raises(AssertionError):
            check(client, "host", frozenset())


def test_a_limit_declared_unsupported_must_be_refused_by_name(agent_settings):
    """Declaring a limit unsupported is checked too: a backend that then accepts it (and so
    drops it silently) fails the kit."""
    with broken_client(LimitIgnoringBackend, agent_settings) as client:
        with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
            isolation.test_memory_limit_is_enforced(client, "host", frozenset({"memory"}))
