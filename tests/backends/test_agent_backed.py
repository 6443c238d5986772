"""The agent-backed base's own decisions, on an agent address where nothing answers (a bound,
never-listening socket: connection refused, and no one else can take the port)."""

from __future__ import annotations

import asyncio
import socket
from typing import Optional

import pytest

from orchard.backends.agent_backed import AgentBackedBackend, AgentSite
from orchard.backends.api import BackendConfig
from orchard.client.http import ApiClient
from orchard.errors import AgentUnreachable, BackendUnavailable
from orchard.models import SandboxSpec


class SiteThatGoesAway(AgentBackedBackend):
    """One site whose agent stopped answering; ``recheck`` says why (or does not know)."""

    name = "site-that-goes-away"

    def __init__(self, url: str, lost_on_recheck: Optional[str]) -> None:
        super().__init__(BackendConfig())
        self.api = ApiClient(url, retries=0)
        self.lost_on_recheck = lost_on_recheck
        self.released: list[tuple[str, bool]] = []

    def _site(self, lost: Optional[str] = None) -> AgentSite:
        return AgentSite("pilot-1", self.api, None, placed=set(), lost=lost)

    async def place(self, spec: SandboxSpec) -> AgentSite:
        return self._site()

    async def locate(self, sandbox_id: str) -> AgentSite:
        return self._site()

    async def sites(self) -> list[AgentSite]:
        return [self._site()]

    async def recheck(self, site: AgentSite) -> AgentSite:
        if self.lost_on_recheck == "scheduler down":
            raise BackendUnavailable("squeue did not answer within 15 s")
        return self._site(self.lost_on_recheck)

    async def release(self, site: AgentSite, sandbox_id: str, *, failed: bool = False) -> None:
        self.released.append((sandbox_id, failed))


@pytest.fixture
def refused_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def create(backend: SiteThatGoesAway) -> None:
    async def run() -> None:
        try:
            await backend.create(SandboxSpec(sandbox_id="sbx-a"))
        finally:
            await backend.api.close()
    asyncio.run(run())


def test_an_agent_whose_job_ended_under_the_create_says_why(refused_url):
    """A pilot warned by Slurm between placement and the create (seen in CI) ended the create
    with a bare connection error; it now names the job's end, as a retryable 503."""
    backend = SiteThatGoesAway(refused_url, "its pilot, Slurm job 7, stopped on SIGUSR2 (time limit near)")
    with pytest.raises(BackendUnavailable, match="sbx-a.*stopped on SIGUSR2") as caught:
        create(backend)
    assert caught.value.status_code == 503 and caught.value.to_body()["error"]["retryable"]  # placed afresh when sent again
    assert backend.released == [("sbx-a", True)]


def test_an_agent_unreachable_for_no_known_reason_stays_unreachable(refused_url):
    backend = SiteThatGoesAway(refused_url, None)
    with pytest.raises(AgentUnreachable):
        create(backend)
    assert backend.released == [("sbx-a", True)]


def test_a_scheduler_that_cannot_say_why_leaves_the_agents_error(refused_url):
    backend = SiteThatGoesAway(refused_url, "scheduler down")
    with pytest.raises(AgentUnreachable, match="127.0.0.1"):
        create(backend)
    assert backend.released == [("sbx-a", True)]
