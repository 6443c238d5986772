"""One async HTTP client for the Orchard Env API, against a server or an agent alike.

Transient failures (connection refused or reset, 503) are retried with exponential
backoff, but only for calls that are safe to repeat; exec is made safe by a job id
chosen on the client, so a retried exec never runs twice.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import random
import ssl
from typing import Any, AsyncIterator, Optional

import httpx

from orchard.errors import AgentUnreachable, OrchardError, error_from_body

TRANSIENT_STATUS = {502, 503, 504}
TRANSIENT_ERRORS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
                    httpx.PoolTimeout, httpx.ConnectTimeout)


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    """One verified TLS context for all pools: building one loads the CA bundle (~50 ms)."""
    return ssl.create_default_context()


def make_http_client(url: str, api_key: Optional[str], timeout: float, max_connections: int) -> httpx.AsyncClient:
    headers = {"X-API-Key": api_key} if api_key else {}
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    verify: ssl.SSLContext | bool = _tls_context() if url.startswith("https://") else False
    if url.startswith("unix://"):
        transport = httpx.AsyncHTTPTransport(uds=url.removeprefix("unix://"), limits=limits, verify=False)
        return httpx.AsyncClient(base_url="http://orchard-agent", transport=transport, headers=headers,
                                 timeout=timeout)
    transport = httpx.AsyncHTTPTransport(limits=limits, verify=verify)
    return httpx.AsyncClient(base_url=url.rstrip("/"), transport=transport, headers=headers, timeout=timeout)


class ApiClient:
    """Connections are spread over small httpx pools used in turn: httpcore scans every
    queued request against every pooled connection, which at 64+ concurrent calls cost
    the client more CPU than the agent spent running the commands."""

    POOL_SIZE = 8

    def __init__(self, url: str, api_key: Optional[str] = None, *, timeout: float = 60.0, retries: int = 5,
                 max_connections: int = 128) -> None:
        self.url = url
        self.retries = retries
        pools = max(1, -(-max_connections // self.POOL_SIZE))
        self._pools = [make_http_client(url, api_key, timeout, self.POOL_SIZE) for _ in range(pools)]
        self._next = itertools.cycle(self._pools)

    @property
    def http(self) -> httpx.AsyncClient:
        return next(self._next)

    async def close(self) -> None:
        for pool in self._pools:
            await pool.aclose()

    async def request(self, method: str, path: str, *, json_body: Any = None, params: Optional[dict] = None,
                      headers: Optional[dict] = None, timeout: Optional[float] = None, idempotent: bool = True,
                      content: Optional[bytes] = None, raw_response: bool = False) -> Any:
        """JSON in and out by default; ``content`` sends bytes, ``raw_response`` returns bytes."""
        attempt = 0
        while True:
            try:
                response = await self.http.request(
                    method, path, json=json_body, params=params, headers=headers, content=content,
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
            except TRANSIENT_ERRORS as exc:
                if not idempotent or attempt >= self.retries:
                    raise AgentUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
            except httpx.TimeoutException as exc:
                if not idempotent or attempt >= self.retries:
                    raise AgentUnreachable(f"{self.url}{path}: timed out ({type(exc).__name__})") from None
            else:
                if response.status_code < 400:
                    return response.content if raw_response else response.json()
                if response.status_code not in TRANSIENT_STATUS or not idempotent or attempt >= self.retries:
                    raise self._error(response)
            attempt += 1
            await asyncio.sleep(min(2.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))

    @staticmethod
    def _error(response: httpx.Response) -> OrchardError:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        return error_from_body(response.status_code, body)

    async def stream(self, path: str, json_body: Any, timeout: Optional[float] = None) -> AsyncIterator[dict]:
        """POST and yield each NDJSON event as it arrives."""
        try:
            async with self.http.stream("POST", path, json=json_body,
                                        timeout=httpx.Timeout(timeout, connect=10.0) if timeout else None) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise self._error(response)
                async for line in response.aiter_lines():
                    if line.strip():
                        yield json.loads(line)
        except TRANSIENT_ERRORS as exc:
            raise AgentUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
