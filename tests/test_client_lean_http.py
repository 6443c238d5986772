"""The lean HTTP client (orchard.client.lean_http) against real sockets on loopback that
answer the way servers, proxies and broken peers do: kept-alive and stale connections,
answers without a length, chunked, too large, malformed, late, or never."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Awaitable, Callable

import pytest

from orchard.client.http import ApiClient
from orchard.errors import AgentUnreachable, InternalError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.setdefault(name.strip().lower(), value.strip())
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return head[0], headers, body


def answer(body: bytes, status: int = 200, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


class RawServer:
    """asyncio.start_server with a handler per connection; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.open = 0
        self.most_open = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await self.handler(reader, writer, self.connections)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def start(self, uds: str | None = None) -> str:
        if uds is not None:
            self.server = await asyncio.start_unix_server(self._serve, uds)
            return f"unix://{uds}"
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.server.close()


def run(handler: Handler, calls: Callable[[ApiClient, RawServer], Awaitable[object]], uds: bool = False,
        **client_options: object) -> tuple[object, RawServer]:
    async def main() -> tuple[object, RawServer]:
        server = RawServer(handler)
        with tempfile.TemporaryDirectory() as tmp:
            url = await server.start(str(Path(tmp) / "s.sock") if uds else None)
            client = ApiClient(url, "key", **client_options)  # type: ignore[arg-type]
            try:
                return await calls(client, server), server
            finally:
                await client.close()
                await server.stop()
    return asyncio.run(main())


def keep_alive(record: list | None = None) -> Handler:
    """Answers every request on the connection with its path and body."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            line, headers, body = await read_request(reader)
            if record is not None:
                record.append((line, headers, body))
            writer.write(answer(json.dumps({"line": line, "body": body.decode()}).encode()))
            await writer.drain()
    return handler


def test_sequential_calls_share_one_connection_and_send_what_was_asked():
    requests: list = []

    async def calls(client: ApiClient, server: RawServer) -> object:
        return [await client.request("POST", f"/sandboxes/s{i}/exec", json_body={"i": i}) for i in range(20)]

    results, server = run(keep_alive(requests), calls)
    assert server.connections == 1
    assert [r["line"] for r in results] == [f"POST /sandboxes/s{i}/exec HTTP/1.1" for i in range(20)]
    assert [json.loads(r["body"]) for r in results] == [{"i": i} for i in range(20)]
    line, headers, _ = requests[0]
    assert headers["x-api-key"] == "key" and headers["content-type"] == "application/json"
    assert headers["host"].startswith("127.0.0.1:")


def test_a_per_call_key_replaces_the_clients_key_rather_than_adding_a_second():
    requests: list = []

    async def calls(client: ApiClient, server: RawServer) -> object:
        return await client.request("GET", "/jobs/j", headers={"X-API-Key": "sandbox-token"})

    run(keep_alive(requests), calls)
    _, headers, _ = requests[0]
    raw = [name for name in headers]  # read_request keeps the first of a repeated header
    assert headers["x-api-key"] == "sandbox-token" and raw.count("x-api-key") == 1


def test_concurrent_calls_open_at_most_the_limit_and_reuse_them():
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            await asyncio.sleep(0.01)
            writer.write(answer(b"{}"))
            await writer.drain()

    async def calls(client: ApiClient, server: RawServer) -> object:
        return await asyncio.gather(*(client.request("GET", "/x") for _ in range(60)))

    results, server = run(slow, calls, max_connections=4)
    assert results == [{}] * 60
    assert server.most_open <= 4 and server.connections <= 4


def test_a_connection_the_server_closed_while_idle_is_replaced_without_an_error():
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(answer(b'{"n": %d}' % n))
        await writer.drain()
        # keep-alive promised, then closed without a word when the next request comes
        await reader.readuntil(b"\r\n\r\n")

    async def calls(client: ApiClient, server: RawServer) -> object:
        return [await client.request("GET", "/x") for _ in range(3)]

    results, server = run(one_then_close, calls, retries=0)
    assert results == [{"n": 1}, {"n": 2}, {"n": 3}]  # no retries left: the stale reuse was replaced at once
    assert server.connections == 3


def test_an_answer_without_a_length_ends_with_the_connection():
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"whole": ')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b'"yes"}')
        await writer.drain()

    async def calls(client: ApiClient, server: RawServer) -> object:
        return [await client.request("GET", "/x"), await client.request("GET", "/y")]

    results, server = run(until_close, calls)
    assert results == [{"whole": "yes"}] * 2 and server.connections == 2


def test_a_chunked_answer_is_read_whole():
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"5\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\n\r\n")
            await writer.drain()

    results, server = run(chunked, lambda client, server: asyncio.gather(client.request("GET", "/x"),
                                                                         client.request("GET", "/x")))
    assert results == [{"a": 1}, {"a": 1}]


def test_an_answer_over_the_cap_is_refused_and_its_connection_dropped(monkeypatch):
    monkeypatch.setattr("orchard.client.http.MAX_JSON_ANSWER", 1000)

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            _, _, body = await read_request(reader)
            payload = b'{"x": "' + b"a" * (5000 if body == b'"big"' else 10) + b'"}'
            writer.write(answer(payload))
            await writer.drain()

    async def calls(client: ApiClient, server: RawServer) -> object:
        with pytest.raises(InternalError, match="more than 1000 bytes"):
            await client.request("POST", "/x", json_body="big")
        return await client.request("POST", "/x", json_body="small")

    result, server = run(big, calls)
    assert result == {"x": "a" * 10} and server.connections == 2


def test_malformed_answers_and_silence_are_agent_unreachable_not_a_hang():
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def calls(client: ApiClient, server: RawServer) -> object:
        with pytest.raises(AgentUnreachable, match="malformed"):
            await client.request("GET", "/x")
        return None

    _, server = run(garbage, calls, retries=1)
    assert server.connections == 2  # retried once on a fresh connection

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{")  # then nothing
        await writer.drain()
        await asyncio.sleep(5)

    async def timed(client: ApiClient, server: RawServer) -> object:
        start = asyncio.get_running_loop().time()
        with pytest.raises(AgentUnreachable, match="timed out"):
            await client.request("GET", "/x", timeout=0.3)
        return asyncio.get_running_loop().time() - start

    took, _ = run(silent, timed, retries=0)
    assert 0.25 < took < 3


def test_a_slow_answer_that_keeps_coming_is_not_cut_by_the_silence_timeout():
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n")
        for piece in (b'{"a":', b'"b', b'cd', b'e"}'):
            await asyncio.sleep(0.4)  # each gap well within the timeout, all of them together beyond it
            writer.write(piece)
            await writer.drain()

    result, _ = run(trickle, lambda client, server: client.request("GET", "/x", timeout=1.0), retries=0)
    assert result == {"a": "bcde"}


def test_a_cancelled_call_drops_its_connection_and_the_next_call_gets_its_own_answer():
    async def answers_late_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            _, _, body = await read_request(reader)
            if body == b'"slow"':
                seen.set()
                await asyncio.sleep(0.3)
            writer.write(answer(body))
            await writer.drain()

    async def calls(client: ApiClient, server: RawServer) -> object:
        slow = asyncio.ensure_future(client.request("POST", "/x", json_body="slow"))
        await asyncio.wait_for(seen.wait(), 10)  # on the wire, its answer not yet
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        return await client.request("POST", "/x", json_body="fast")

    seen = asyncio.Event()
    result, server = run(answers_late_first, calls)
    assert result == "fast" and server.connections == 2


def test_unusual_paths_and_a_mounted_prefix_still_reach_the_server():
    requests: list = []

    async def calls(client: ApiClient, server: RawServer) -> object:
        await client.request("GET", "/files", params={"path": "/a b/ü"})  # encoded by urlencode: lean
        await client.request("GET", "/odd path")  # a space: sent by aiohttp, which encodes it
        return None

    run(keep_alive(requests), calls)
    assert requests[0][0] == "GET /files?path=%2Fa+b%2F%C3%BC HTTP/1.1"
    assert requests[1][0] == "GET /odd%20path HTTP/1.1"

    async def main() -> str:
        server = RawServer(keep_alive())
        url = await server.start()
        client = ApiClient(url + "/orchard/", "key")
        try:
            return (await client.request("GET", "/health"))["line"]
        finally:
            await client.close()
            await server.stop()
    assert asyncio.run(main()) == "GET /orchard/health HTTP/1.1"


def test_over_a_unix_socket():
    requests: list = []
    result, server = run(keep_alive(requests), lambda client, server: client.request("GET", "/x"), uds=True)
    assert result["line"] == "GET /x HTTP/1.1" and requests[0][1]["host"] == "orchard-agent"


def test_header_values_that_would_split_the_request_are_never_sent_raw():
    requests: list = []

    async def calls(client: ApiClient, server: RawServer) -> object:
        with pytest.raises(ValueError, match="header injection"):  # aiohttp's refusal: lean left it alone
            await client.request("GET", "/x", headers={"x-extra": "a\r\nx-api-key: stolen"})
        return None

    run(keep_alive(requests), calls)
    assert all("stolen" not in json.dumps(r[1]) for r in requests)


# -- what a hostile review found (a server beside hostile code may answer anything) --------

def test_an_endless_answer_head_is_refused_early_without_stalling_the_loop():
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-big: ")
        for _ in range(64):  # 16 MiB of one header value, if anyone kept reading
            writer.write(b"a" * (256 << 10))
            await writer.drain()

    async def calls(client: ApiClient, server: RawServer) -> object:
        with pytest.raises(AgentUnreachable, match="head of more than"):  # not read on until the silence timeout
            await client.request("GET", "/x")
        return None

    run(endless, calls, retries=0)


def test_an_informational_answer_is_followed_by_the_real_one():
    async def early_hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + answer(b'"real"'))
            await writer.drain()

    results, server = run(early_hints, lambda client, server: asyncio.gather(
        client.request("GET", "/x"), client.request("GET", "/x")))
    assert results == ["real", "real"]


def test_bytes_after_a_whole_answer_never_become_the_next_calls_answer():
    async def talks_too_much(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(answer(b'"one"') + b'HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n"smugg')
            await writer.drain()

    async def calls(client: ApiClient, server: RawServer) -> object:
        return [await client.request("GET", "/x") for _ in range(3)]

    results, server = run(talks_too_much, calls)
    assert results == ["one"] * 3 and server.connections == 3


def test_answers_without_a_body_keep_their_connection():
    async def no_content(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

    async def calls(client: ApiClient, server: RawServer) -> object:
        return [await client.request("DELETE", "/x", raw_response=True) for _ in range(3)]

    results, server = run(no_content, calls)
    assert results == [b""] * 3 and server.connections == 1


def test_no_silence_timer_outlives_its_call():
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
        for piece in (b"[1", b",2", b"]"):
            await asyncio.sleep(0.4)
            writer.write(piece)
            await writer.drain()

    async def calls(client: ApiClient, server: RawServer) -> object:
        await client.request("GET", "/x", timeout=1.0)
        scheduled = asyncio.get_running_loop()._scheduled  # type: ignore[attr-defined]
        return [h for h in scheduled if not h.cancelled() and "_check_silence" in repr(h)]

    left, _ = run(trickle, calls, retries=0)
    assert left == []


def test_a_callers_own_framing_headers_and_credentials_go_to_aiohttp():
    requests: list = []

    async def calls(client: ApiClient, server: RawServer) -> object:
        await client.request("GET", "/x", headers={"Host": "elsewhere"})
        return client._lean_request("GET", client.origin + "/x", {"transfer-encoding": "chunked"}, None)

    lean, _ = run(keep_alive(requests), calls)
    assert lean is None
    assert [h["host"] for _, h, _ in requests] == ["elsewhere"]
    assert ApiClient("http://user:pw@127.0.0.1:9/")._lean_host is None
    assert ApiClient("http://127.0.0.1:99999/")._lean_host is None  # aiohttp names the bad port when called


def test_a_raw_answer_is_capped_when_the_caller_asks():
    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(answer(b"x" * 5000))
            await writer.drain()

    async def calls(client: ApiClient, server: RawServer) -> object:
        with pytest.raises(InternalError, match="more than 1000 bytes"):
            await client.request("POST", "/x", json_body={}, raw_response=True, answer_cap=1000)
        return await client.request("POST", "/x", json_body={}, raw_response=True)

    result, _ = run(big, calls)
    assert result == b"x" * 5000


def test_waiting_for_a_free_connection_is_bounded_like_a_connect(monkeypatch):
    monkeypatch.setattr("orchard.client.http.CONNECT_TIMEOUT", 0.2)

    async def stuck(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await asyncio.sleep(3)

    async def calls(client: ApiClient, server: RawServer) -> object:
        first = asyncio.ensure_future(client.request("GET", "/slow", timeout=5))
        while server.connections < 1:  # the one connection is taken
            await asyncio.sleep(0.01)
        start = asyncio.get_running_loop().time()
        with pytest.raises(AgentUnreachable, match="no free connection"):
            await client.request("GET", "/queued")
        took = asyncio.get_running_loop().time() - start
        first.cancel()
        return took

    took, _ = run(stuck, calls, max_connections=1, retries=0)
    assert took < 1.5


def test_no_read_timeout_means_none():
    result, _ = run(keep_alive(), lambda client, server: client.request("GET", "/x"), timeout=None)
    assert result["line"] == "GET /x HTTP/1.1"


def test_a_connection_closed_before_its_request_is_a_typed_error_under_uvloop(monkeypatch):
    """Found in CI: an agent killed with a connection in its listen backlog. The connect
    succeeded, the server's close was processed, and uvloop raised RuntimeError on the write
    ("the handler is closed"), which the server answered as a 500 instead of a 410."""
    import uvloop

    from orchard.client import lean_http

    connect = lean_http.LeanPool._connect

    async def connect_then_wait(self: lean_http.LeanPool, connect_timeout: float) -> object:
        connection = await connect(self, connect_timeout)
        await asyncio.sleep(0.2)  # the server's close is processed before the request goes out
        return connection

    monkeypatch.setattr(lean_http.LeanPool, "_connect", connect_then_wait)

    async def closes_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.close()

    async def main() -> int:
        server = RawServer(closes_at_once)
        client = ApiClient(await server.start(), "key", retries=1)
        try:
            with pytest.raises(AgentUnreachable):
                await client.request("GET", "/x")
        finally:
            await client.close()
            await server.stop()
        return server.connections

    assert uvloop.run(main()) == 2  # retried once on a fresh connection, then typed
