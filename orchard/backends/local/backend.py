"""``local``: sandboxes on this machine (the embedded default).

The backend itself is thin: it makes sure this machine's exec agent runs (a
separate, long-lived process) and forwards life-cycle calls to it.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any, Optional

from pydantic import Field

from orchard.agent.settings import AgentSettings
from orchard.backends.api import AgentEndpoint, Backend, BackendConfig
from orchard.backends.local.launcher import ensure_agent
from orchard.client.http import ApiClient
from orchard.errors import AgentUnreachable
from orchard.models import Sandbox, SandboxSpec


class LocalBackendConfig(BackendConfig):
    agent: AgentSettings = Field(default_factory=AgentSettings, description="settings of the local exec agent")


class LocalBackend(Backend):
    name = "local"
    config_model = LocalBackendConfig

    def __init__(self, config: LocalBackendConfig) -> None:
        super().__init__(config)
        self.config: LocalBackendConfig = config
        self._endpoint: Optional[AgentEndpoint] = None
        self._api: Optional[ApiClient] = None
        self._retired: list[ApiClient] = []  # clients of agents that died, closed with the backend
        self._lock = asyncio.Lock()

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if shutil.which("bwrap") is None:
            return "bubblewrap is not installed (apt-get install bubblewrap); runtime 'direct' only by name"
        return None

    async def agent(self) -> ApiClient:
        if self._api is None:
            async with self._lock:
                if self._api is None:
                    self._endpoint = await asyncio.to_thread(ensure_agent, self.config.agent)
                    self._api = ApiClient(self._endpoint.url, self._endpoint.token, retries=2)
        return self._api

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """A call to the agent; if it died, a new agent is started and the call made once more
        (its sandboxes died with the old one: callers then see them as not found)."""
        api = await self.agent()
        try:
            return await api.request(method, path, **kwargs)
        except AgentUnreachable:
            async with self._lock:
                if self._api is api:  # first to notice: retire it (others may still be using it)
                    self._retired.append(api)
                    self._api = None
            return await (await self.agent()).request(method, path, **kwargs)

    async def create(self, spec: SandboxSpec) -> Sandbox:
        timeout = (spec.timeout or self.config.agent.ready_timeout) + 30
        return Sandbox(**await self._request("POST", "/sandboxes", json_body=spec.model_dump(), timeout=timeout))

    async def delete(self, sandbox_id: str) -> None:
        await self._request("DELETE", f"/sandboxes/{sandbox_id}")

    async def list(self) -> list[Sandbox]:
        body = await self._request("GET", "/sandboxes")
        return [Sandbox(**item) for item in body["sandboxes"]]

    async def status(self, sandbox_id: str) -> Sandbox:
        return Sandbox(**await self._request("GET", f"/sandboxes/{sandbox_id}"))

    async def endpoint(self, sandbox_id: str) -> AgentEndpoint:
        await self.agent()
        assert self._endpoint is not None
        return self._endpoint

    async def resources(self) -> dict[str, Any]:
        return await self._request("GET", "/resources")

    async def close(self) -> None:
        for api in [self._api, *self._retired]:
            if api is not None:
                await api.close()
        self._api, self._retired = None, []
