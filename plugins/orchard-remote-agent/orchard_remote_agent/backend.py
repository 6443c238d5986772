"""``remote-agent``: sandboxes on an exec agent reachable at a URL (one fixed placement)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from orchard.backends.agent_backed import AgentBackedBackend, AgentSite
from orchard.backends.api import RESET, SNAPSHOTS, AgentEndpoint, BackendConfig
from orchard.client.http import ApiClient
from orchard.models import SandboxSpec


class RemoteAgentConfig(BackendConfig):
    url: str = Field(description="the agent's address: http://host:port or unix:///path")
    token: Optional[str] = Field(None, description="the agent's X-API-Key (ORCHARD_AGENT_TOKEN where it runs)")


class RemoteAgentBackend(AgentBackedBackend):
    name = "remote-agent"
    config_model = RemoteAgentConfig
    capabilities = frozenset({SNAPSHOTS, RESET})  # optional features: the agent does them, forks stay on it

    def __init__(self, config: RemoteAgentConfig) -> None:
        super().__init__(config)
        self.config: RemoteAgentConfig = config
        self.api = ApiClient(config.url, config.token)
        self.site = AgentSite(config.url, self.api, AgentEndpoint(url=config.url, token=config.token))

    async def place(self, spec: SandboxSpec) -> AgentSite:
        return self.site

    async def place_fork(self, spec: SandboxSpec, site: AgentSite) -> AgentSite:
        return site

    async def locate(self, sandbox_id: str) -> AgentSite:
        return self.site

    async def sites(self) -> list[AgentSite]:
        return [self.site]

    async def resources(self) -> dict[str, Any]:
        return await self.api.request("GET", "/resources")

    async def close(self) -> None:
        await self.api.close()
