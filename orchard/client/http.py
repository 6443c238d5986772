"""One async HTTP client for the Orchard Env API, against a server or an agent alike.

Transient failures (connection refused or reset, 503) are retried with exponential
backoff, but only for calls that are safe to repeat; exec is made safe by a job id
chosen on the client, so a retried exec never runs twice.

Built on httpcore (httpx's own transport layer) rather than on httpx's client: every
exec goes through here twice (SDK -> server -> agent), and httpx's request building,
auth and redirect layers cost ~0.3 ms a call, a third of the client's CPU per command.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import random
import ssl
from typing import Any, AsyncIterator, Optional
from urllib.parse import urlencode, urlsplit

import httpcore

from orchard.errors import AgentUnreachable, OrchardError, error_from_body

TRANSIENT_STATUS = {502, 503, 504}
TRANSIENT_ERRORS = (httpcore.ConnectError, httpcore.RemoteProtocolError, httpcore.ReadError, httpcore.WriteError,
                    httpcore.PoolTimeout, httpcore.ConnectTimeout)
CONNECT_TIMEOUT = 10.0


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    """One verified TLS context for all pools: building one loads the CA bundle (~50 ms)."""
    return ssl.create_default_context()


class ScopedApi:
    """An ApiClient that sends its own key with every call (a per-sandbox agent token)."""

    def __init__(self, api: "ApiClient", api_key: str) -> None:
        self.api = api
        self.headers = {"x-api-key": api_key}

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        return await self.api.request(method, path, headers={**(kwargs.pop("headers", None) or {}), **self.headers},
                                      **kwargs)

    def stream(self, path: str, json_body: Any, timeout: Optional[float] = None) -> AsyncIterator[dict]:
        return self.api.stream(path, json_body, timeout=timeout, headers=self.headers)


class ApiClient:
    """Connections are spread over small pools used in turn: httpcore scans every queued
    request against every pooled connection, which at 64+ concurrent calls cost the client
    more CPU than the agent spent running the commands."""

    POOL_SIZE = 2

    def __init__(self, url: str, api_key: Optional[str] = None, *, timeout: float = 60.0, retries: int = 5,
                 max_connections: int = 128) -> None:
        self.url = url
        self.retries = retries
        self.timeout = timeout
        uds = None
        if url.startswith("unix://"):
            uds, self.origin = url.removeprefix("unix://"), "http://orchard-agent"
        else:
            self.origin = url.rstrip("/")
        parts = urlsplit(self.origin)
        self.base_path = parts.path
        self.headers = [(b"host", parts.netloc.encode()), (b"accept", b"application/json")]
        if api_key:
            self.headers.append((b"x-api-key", api_key.encode()))
        tls = _tls_context() if parts.scheme == "https" else None
        pools = max(1, -(-max_connections // self.POOL_SIZE))
        self._pools = [httpcore.AsyncConnectionPool(max_connections=self.POOL_SIZE, uds=uds, ssl_context=tls,
                                                    keepalive_expiry=60.0) for _ in range(pools)]
        self._next = itertools.cycle(self._pools)

    async def close(self) -> None:
        for pool in self._pools:
            await pool.aclose()

    def _prepare(self, path: str, params: Optional[dict], json_body: Any, content: Optional[bytes],
                 headers: Optional[dict], timeout: Optional[float]) -> tuple[str, list, Optional[bytes], dict]:
        url = f"{self.origin}{path}"
        if params:
            url += "?" + urlencode({k: v for k, v in params.items() if v is not None}, doseq=True)
        all_headers = list(self.headers)
        if json_body is not None:
            content = json.dumps(json_body, separators=(",", ":")).encode()
            all_headers.append((b"content-type", b"application/json"))
        if content is not None:
            all_headers.append((b"content-length", str(len(content)).encode()))
        for key, value in (headers or {}).items():
            name = key.lower().encode()
            all_headers = [h for h in all_headers if h[0] != name] + [(name, str(value).encode())]
        limit = timeout if timeout is not None else self.timeout
        extensions = {"timeout": {"connect": CONNECT_TIMEOUT, "read": limit, "write": limit, "pool": limit}}
        return url, all_headers, content, extensions

    async def request(self, method: str, path: str, *, json_body: Any = None, params: Optional[dict] = None,
                      headers: Optional[dict] = None, timeout: Optional[float] = None, idempotent: bool = True,
                      content: Optional[bytes] = None, raw_response: bool = False) -> Any:
        """JSON in and out by default; ``content`` sends bytes, ``raw_response`` returns bytes."""
        url, all_headers, body, extensions = self._prepare(path, params, json_body, content, headers, timeout)
        attempt = 0
        while True:
            try:
                response = await next(self._next).request(method, url, headers=all_headers, content=body,
                                                          extensions=extensions)
            except TRANSIENT_ERRORS as exc:
                if not idempotent or attempt >= self.retries:
                    raise AgentUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
            except httpcore.TimeoutException as exc:
                if not idempotent or attempt >= self.retries:
                    raise AgentUnreachable(f"{self.url}{path}: timed out ({type(exc).__name__})") from None
            else:
                if response.status < 400:
                    return response.content if raw_response else json.loads(response.content)
                if response.status not in TRANSIENT_STATUS or not idempotent or attempt >= self.retries:
                    raise self._error(response.status, response.content)
            attempt += 1
            await asyncio.sleep(min(2.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))

    @staticmethod
    def _error(status: int, content: bytes) -> OrchardError:
        try:
            body: Any = json.loads(content)
        except ValueError:
            body = content.decode(errors="replace")
        return error_from_body(status, body)

    async def stream(self, path: str, json_body: Any, timeout: Optional[float] = None,
                     headers: Optional[dict] = None) -> AsyncIterator[dict]:
        """POST and yield each NDJSON event as it arrives."""
        url, all_headers, body, extensions = self._prepare(path, None, json_body, None, headers, timeout)
        try:
            async with next(self._next).stream("POST", url, headers=all_headers, content=body,
                                               extensions=extensions) as response:
                if response.status >= 400:
                    raise self._error(response.status, await response.aread())
                pending = b""
                async for chunk in response.aiter_stream():
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
                if pending.strip():
                    yield json.loads(pending)
        except TRANSIENT_ERRORS as exc:
            raise AgentUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
