"""``remote-agent``: sandboxes on an exec agent reachable at a URL."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from orchard.backends.api import AgentEndpoint, Backend, BackendConfig
from orchard.client.http import ApiClient
from orchard.models import Sandbox, SandboxSpec


class RemoteAgentConfig(BackendConfig):
    url: str = Field(description="the agent's address: http://host:port or unix:///path")
    token: Optional[str] = Field(None, description="the agent's X-API-Key (ORCHARD_AGENT_TOKEN where it runs)")


class RemoteAgentBackend(Backend):
    name = "remote-agent"
    config_model = RemoteAgentConfig

    def __init__(self, config: RemoteAgentConfig) -> None:
        super().__init__(config)
        self.config: RemoteAgentConfig = config
        self.api = ApiClient(config.url, config.token)

    async def create(self, spec: SandboxSpec) -> Sandbox:
        body = await self.api.request("POST", "/sandboxes", json_body=spec.model_dump(), timeout=(spec.timeout or 60) + 30)
        return Sandbox(**{**body, "backend": self.name})

    async def delete(self, sandbox_id: str) -> None:
        await self.api.request("DELETE", f"/sandboxes/{sandbox_id}")

    async def list(self) -> list[Sandbox]:
        body = await self.api.request("GET", "/sandboxes")
        return [Sandbox(**{**item, "backend": self.name}) for item in body["sandboxes"]]

    async def status(self, sandbox_id: str) -> Sandbox:
        return Sandbox(**{**await self.api.request("GET", f"/sandboxes/{sandbox_id}"), "backend": self.name})

    async def endpoint(self, sandbox_id: str) -> AgentEndpoint:
        return AgentEndpoint(url=self.config.url, token=self.config.token)

    async def resources(self) -> dict[str, Any]:
        return await self.api.request("GET", "/resources")

    async def close(self) -> None:
        await self.api.close()
