"""One async HTTP client for the Orchard Env API, against a server or an agent alike.

Transient failures (connection refused or reset, 503) are retried with exponential
backoff, but only for calls that are safe to repeat; exec is made safe by a job id
chosen on the client, so a retried exec never runs twice.

Every command crosses two such clients (SDK -> server -> agent). Small calls over plain
HTTP (exec above all) go through :mod:`orchard.client.lean_http`, about 0.06 ms of CPU a
call; TLS, streamed bodies, downloads, NDJSON streams and WebSockets through aiohttp's
client, about 0.2 ms (httpcore, h11 over anyio, cost 0.9-1.5 ms: `docs/benchmarks.md`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import ssl
from typing import Any, AsyncIterator, Optional, Union
from urllib.parse import urlencode, urlsplit

import aiohttp

from orchard.client.lean_http import SAFE_HEADER_VALUE, SAFE_TARGET, LeanConnectionError, LeanPool, answer_cap
from orchard.errors import AgentUnreachable, AnswerTooLarge, InternalError, OrchardError, error_from_body

TRANSIENT_STATUS = {502, 503, 504}
TRANSIENT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, LeanConnectionError)
CONNECT_TIMEOUT = 10.0


@functools.lru_cache(maxsize=8)
def _tls_context(ca_file: Optional[str] = None) -> ssl.SSLContext:
    """One verified TLS context per trust root: building one loads the CA bundle (~50 ms).
    ``ca_file`` pins the server: only certificates it vouches for are accepted."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()


STREAM_ABOVE = 4 << 20  # larger bodies are sent in chunks
MAX_JSON_ANSWER = 64 << 20  # an agent (in per-job mode, beside hostile code) must not make us hold more


async def _read_capped(response: aiohttp.ClientResponse, cap: Optional[int], where: str) -> bytes:
    cap = answer_cap(cap, response.status)
    if cap is None:
        return await response.read()
    if response.content_length is not None and response.content_length > cap:
        raise AnswerTooLarge(f"{where}: answered more than {cap} bytes (its length: {response.content_length}); refused")
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > cap:
            raise AnswerTooLarge(f"{where}: answered more than {cap} bytes; refused")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(payload: bytes, where: str) -> Any:
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        raise InternalError(f"{where}: answered something that is no JSON we can read") from None


def _worth_retrying(status: int, payload: bytes) -> bool:
    """Our errors say whether they are worth retrying; a bare 502/503/504 (a proxy, a server
    at its connection limit) is. A deterministic failure is never sent again: one bad create
    used to start a sandbox up to 18 times through the server."""
    if status not in TRANSIENT_STATUS:
        return False
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError):
        return True
    return bool(error.get("retryable", True)) if isinstance(error, dict) else True


async def _in_chunks(body: bytes, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """A large body a piece at a time: handed over whole, aiohttp copies it into the
    transport's buffer at once, stalling this loop (and every other call on it) for
    ~200 ms per 100 MB. Made anew for each attempt, so retries still work."""
    view = memoryview(body)
    for start in range(0, len(view), size):
        yield view[start:start + size]


FRAMING_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "expect"}


def _lean_address(origin: str, uds: Optional[str]) -> Optional[tuple[str, str, tuple[str, int]]]:
    """The Host line every lean request carries, the path the origin mounts the API at,
    and where it connects; None for an origin the lean client leaves to aiohttp (one with
    credentials, or a port that is no port: aiohttp says what is wrong with it; TLS)."""
    if uds is None and not origin.startswith("http://"):
        return None
    parts = urlsplit(origin)
    try:
        port = parts.port or 80
    except ValueError:
        return None
    if parts.username is not None or parts.password is not None:
        return None
    host = f"host: {parts.netloc if uds is None else 'orchard-agent'}"
    return host, parts.path.rstrip("/"), (parts.hostname or "", port)


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

    async def download(self, path: str, **kwargs: Any) -> tuple[Optional[int], AsyncIterator[bytes]]:
        return await self.api.download(path, headers={**(kwargs.pop("headers", None) or {}), **self.headers}, **kwargs)

    async def websocket(self, path: str) -> aiohttp.ClientWebSocketResponse:
        return await self.api.websocket(path, headers=self.headers)


class ApiClient:
    """The session is opened on first use, in the loop that uses it (the sync SDK builds
    clients on one thread and runs them on its loop thread)."""

    def __init__(self, url: str, api_key: Optional[str] = None, *, timeout: float = 60.0, retries: int = 5,
                 max_connections: int = 128, ca_file: Optional[str] = None) -> None:
        self.url = url
        self.ca_file = ca_file
        self.retries = retries
        self.timeout = timeout
        self.max_connections = max_connections
        self.uds: Optional[str] = None
        if url.startswith("unix://"):
            self.uds, self.origin = url.removeprefix("unix://"), "http://orchard-agent"
        else:
            self.origin = url.rstrip("/")
        self.headers = {"accept": "application/json"}
        if api_key:
            self.headers["x-api-key"] = api_key
        self._session: Optional[aiohttp.ClientSession] = None
        self._lean: Optional[LeanPool] = None
        self._lean_host: Optional[str] = None  # None: every call goes through aiohttp (TLS)
        lean = _lean_address(self.origin, self.uds)
        if lean is not None:
            self._lean_host, self._lean_prefix, self._lean_at = lean

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector: aiohttp.BaseConnector
            if self.uds is not None:
                connector = aiohttp.UnixConnector(path=self.uds, limit=self.max_connections, keepalive_timeout=60.0)
            else:
                tls = _tls_context(self.ca_file) if self.origin.startswith("https://") else None
                connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=60.0, ssl=tls or False)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers,
                                                  cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._lean is not None:
            self._lean.close()
            self._lean = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _lean_request(self, method: str, url: str, headers: dict, body: Any) -> Optional[bytes]:
        """The whole request as bytes when the lean client can send it (else None: aiohttp)."""
        if self._lean_host is None or not (body is None or isinstance(body, bytes) and len(body) <= STREAM_ABOVE):
            return None
        target = self._lean_prefix + url[len(self.origin):]
        if method not in ("GET", "POST", "PUT", "DELETE", "PATCH") or not SAFE_TARGET.fullmatch(target):
            return None
        lines = [f"{method} {target} HTTP/1.1", self._lean_host]
        for name, value in {**self.headers, **{k.lower(): v for k, v in headers.items()}}.items():
            if not (isinstance(value, str) and SAFE_TARGET.fullmatch(name) and SAFE_HEADER_VALUE.fullmatch(value)):
                return None  # aiohttp refuses it, or encodes it as it does
            if name in FRAMING_HEADERS:
                return None  # the lean client frames requests itself: a caller's own framing goes to aiohttp
            lines.append(f"{name}: {value}")
        lines.append(f"content-length: {len(body or b'')}\r\n\r\n")
        return "\r\n".join(lines).encode("latin-1") + (body or b"")

    def _lean_pool(self) -> LeanPool:
        if self._lean is None or self._lean.closed or self._lean.loop is not asyncio.get_running_loop():
            if self._lean is not None and self._lean.loop.is_closed():
                self._lean.forget()  # one asyncio.run after another: free the last one's sockets now
            host, port = self._lean_at
            self._lean = LeanPool(host, port, self.uds, self.max_connections)
        return self._lean

    def _prepare(self, path: str, params: Optional[dict], json_body: Any, content: Any,
                 headers: Optional[dict], timeout: Optional[float]) -> tuple[str, dict, Any, Any]:
        url = f"{self.origin}{path}"
        if params:
            url += "?" + urlencode({k: v for k, v in params.items() if v is not None}, doseq=True)
        all_headers = dict(headers or {})
        if json_body is not None:
            content = json.dumps(json_body, separators=(",", ":")).encode()
            all_headers["content-type"] = "application/json"
        limit = timeout if timeout is not None else self.timeout
        return url, all_headers, content, aiohttp.ClientTimeout(connect=CONNECT_TIMEOUT, sock_read=limit)

    async def request(self, method: str, path: str, *, json_body: Any = None, params: Optional[dict] = None,
                      headers: Optional[dict] = None, timeout: Optional[float] = None, idempotent: bool = True,
                      content: Union[bytes, AsyncIterator[bytes], None] = None, raw_response: bool = False,
                      answer_cap: Optional[int] = None) -> Any:
        """JSON in and out by default; ``content`` sends bytes (or streams them: never retried,
        a stream cannot be replayed), ``raw_response`` returns bytes, at most ``answer_cap``
        of them (a JSON answer: at most MAX_JSON_ANSWER)."""
        url, all_headers, body, limits = self._prepare(path, params, json_body, content, headers, timeout)
        if content is not None and not isinstance(content, bytes):
            idempotent = False
        cap = answer_cap if raw_response else MAX_JSON_ANSWER
        lean = self._lean_request(method, url, all_headers, body)
        attempt = 0
        while True:
            try:
                if lean is not None:
                    try:
                        status, payload = await self._lean_pool().send(lean, cap, limits.sock_read, CONNECT_TIMEOUT,
                                                                       retry_stale=idempotent)
                    except AnswerTooLarge as exc:
                        raise AnswerTooLarge(f"{self.url}{path}: {exc}") from None
                else:
                    payload = _in_chunks(body) if isinstance(body, bytes) and len(body) > STREAM_ABOVE else body
                    async with self._open().request(method, url, data=payload, headers=all_headers,
                                                    timeout=limits) as response:
                        status, payload = response.status, await _read_capped(response, cap, f"{self.url}{path}")
            except asyncio.TimeoutError as exc:
                if not idempotent or attempt >= self.retries:
                    raise AgentUnreachable(f"{self.url}{path}: timed out ({type(exc).__name__})") from None
            except TRANSIENT_ERRORS as exc:
                if not idempotent or attempt >= self.retries:
                    raise AgentUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
            else:
                if status < 400:
                    return payload if raw_response else _parse(payload, f"{self.url}{path}")
                if not _worth_retrying(status, payload) or not idempotent or attempt >= self.retries:
                    raise self._error(status, payload)
            attempt += 1
            await asyncio.sleep(min(2.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))

    async def download(self, path: str, params: Optional[dict] = None, headers: Optional[dict] = None,
                       timeout: Optional[float] = None) -> tuple[Optional[int], AsyncIterator[bytes]]:
        """GET a body as a stream: (its length if known, its chunks as they arrive). The
        response stays open until the chunks are consumed or closed."""
        url, all_headers, _, limits = self._prepare(path, params, None, None, headers, timeout)
        try:
            response = await self._open().get(url, headers=all_headers, timeout=limits)
        except (asyncio.TimeoutError, *TRANSIENT_ERRORS) as exc:
            raise AgentUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
        if response.status >= 400:
            try:
                raise self._error(response.status, await response.read())
            finally:
                response.release()

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.content.iter_chunked(1 << 20):
                    yield chunk
            except (asyncio.TimeoutError, *TRANSIENT_ERRORS) as exc:
                raise AgentUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
            finally:
                response.release()

        return response.content_length, chunks()

    async def websocket(self, path: str, headers: Optional[dict] = None) -> aiohttp.ClientWebSocketResponse:
        """Open a WebSocket (the key goes in X-API-Key, never in the URL). A refusal before
        the handshake is AgentUnreachable; one after it is the socket's close code."""
        try:
            return await self._open().ws_connect(f"{self.origin}{path}", headers=headers, autoping=True,
                                                 heartbeat=None, max_msg_size=4 << 20,
                                                 timeout=aiohttp.ClientWSTimeout(ws_close=10.0))
        except (asyncio.TimeoutError, aiohttp.WSServerHandshakeError, *TRANSIENT_ERRORS) as exc:
            raise AgentUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None

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
        url, all_headers, body, limits = self._prepare(path, None, json_body, None, headers, timeout)
        try:
            async with self._open().post(url, data=body, headers=all_headers, timeout=limits) as response:
                if response.status >= 400:
                    raise self._error(response.status, await response.read())
                pending = b""
                async for chunk in response.content.iter_any():
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
                if pending.strip():
                    yield json.loads(pending)
        except (asyncio.TimeoutError, *TRANSIENT_ERRORS) as exc:
            raise AgentUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
