"""``local``: sandboxes on this machine (the embedded default).

The backend itself is thin: its one placement is this machine's exec agent (a separate,
long-lived process it starts when none runs), to which it forwards life-cycle calls.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any, Optional

from pydantic import Field

from orchard.agent.settings import AgentSettings
from orchard.backends.agent_backed import AgentBackedBackend, AgentSite
from orchard.backends.api import RESET, SNAPSHOTS, BackendConfig
from orchard.backends.checks import Check
from orchard.backends.local.checks import local_checks
from orchard.backends.local.launcher import ensure_agent
from orchard.client.http import ApiClient
from orchard.errors import AgentUnreachable
from orchard.models import SandboxSpec


class LocalBackendConfig(BackendConfig):
    agent: AgentSettings = Field(default_factory=AgentSettings, description="settings of the local exec agent")


class LocalBackend(AgentBackedBackend):
    name = "local"
    config_model = LocalBackendConfig
    capabilities = frozenset({SNAPSHOTS, RESET})  # the agent's runtime may still refuse (e.g. the ``host`` image)

    def __init__(self, config: LocalBackendConfig) -> None:
        super().__init__(config)
        self.config: LocalBackendConfig = config
        self._site: Optional[AgentSite] = None
        self._retired: list[ApiClient] = []  # clients of agents that died, closed with the backend
        self._lock = asyncio.Lock()

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if shutil.which("bwrap") is None:
            return "bubblewrap is not installed (apt-get install bubblewrap); runtime 'direct' only by name"
        return None

    @classmethod
    def doctor(cls, settings: dict[str, Any]) -> list[Check]:
        return local_checks()

    def start_timeout(self, spec: SandboxSpec) -> float:
        return spec.timeout or self.config.agent.ready_timeout

    async def agent(self) -> AgentSite:
        """This machine's agent, started if none runs."""
        if self._site is None:
            async with self._lock:
                if self._site is None:
                    endpoint = await asyncio.to_thread(ensure_agent, self.config.agent)
                    self._site = AgentSite("local", ApiClient(endpoint.url, endpoint.token, retries=2), endpoint)
        return self._site

    # -- placement: always this machine's agent ----------------------------------------
    async def place(self, spec: SandboxSpec) -> AgentSite:
        return await self.agent()

    async def place_fork(self, spec: SandboxSpec, site: AgentSite) -> AgentSite:
        return site

    async def locate(self, sandbox_id: str) -> AgentSite:
        return await self.agent()

    async def sites(self) -> list[AgentSite]:
        return [await self.agent()]

    async def forward(self, site: AgentSite, method: str, path: str, **kwargs: Any) -> Any:
        """If the agent died, a new one is started and the call made once more (its sandboxes
        died with the old one: callers then see them as not found)."""
        try:
            return await super().forward(site, method, path, **kwargs)
        except AgentUnreachable:
            async with self._lock:
                if self._site is site:  # first to notice: retire it (others may still be using it)
                    assert site.api is not None
                    self._retired.append(site.api)
                    self._site = None
            return await super().forward(await self.agent(), method, path, **kwargs)

    async def resources(self) -> dict[str, Any]:
        return await self.forward(await self.agent(), "GET", "/resources")

    async def close(self) -> None:
        for api in [self._site.api if self._site else None, *self._retired]:
            if api is not None:
                await api.close()
        self._site, self._retired = None, []
