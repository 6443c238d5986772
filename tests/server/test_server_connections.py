"""The server's connection cap and request-head deadline, against a real `orchard serve`.

About 40,000 idle connections from one sandbox with network used up the server's open files,
requests failed, and the reconciler then deleted other sandboxes for missed heartbeats.
"""

from __future__ import annotations

import socket
import time

import httpx

CAP, HEAD_SECONDS = 24, 1.0


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), 5)
    sock.settimeout(5)
    return sock


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True when the server closes ``sock`` within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_connections_past_the_cap_are_closed_as_they_arrive_and_the_server_recovers(server_factory):
    server = server_factory(max_connections=CAP, header_timeout=30)
    held = [connect(server.port) for _ in range(CAP)]
    try:
        time.sleep(0.3)
        extra = connect(server.port)
        assert closed_by_server(extra, 3), "a connection past max_connections was kept"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200


def test_a_request_head_must_arrive_in_time_even_byte_by_byte(server_factory):
    server = server_factory(header_timeout=HEAD_SECONDS)
    silent = connect(server.port)
    partial = connect(server.port)
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    slow = connect(server.port)
    started = time.monotonic()
    closed_slow = False
    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 40:
        try:
            slow.sendall(bytes([byte]))
        except OSError:
            closed_slow = True
            break
        time.sleep(0.1)
    closed_slow = closed_slow or closed_by_server(slow, 2)
    assert closed_slow and time.monotonic() - started < HEAD_SECONDS + 5
    assert closed_by_server(silent, 3) and closed_by_server(partial, 3)
    with httpx.Client(base_url=server.url, timeout=5) as http:  # a prompt caller is served as before
        assert http.get("/health").status_code == 200
        time.sleep(HEAD_SECONDS + 0.5)  # and its kept-alive connection is not cut between requests by the deadline
        assert http.get("/health").status_code == 200


def test_no_sandbox_is_reaped_for_missed_heartbeats_while_the_server_turns_callers_away(server_factory):
    server = server_factory(max_connections=16, header_timeout=30,
                            reconciler={"interval": 0.5, "heartbeat_ttl": 2.0, "lost_grace": 10})
    with server.http() as http:
        created = http.post("/sandboxes", json={})
        assert created.status_code == 200, created.text
        sandbox_id = created.json()["sandbox_id"]
    held = [connect(server.port) for _ in range(16)]
    try:
        until = time.monotonic() + 6  # three TTLs without a heartbeat getting through
        while time.monotonic() < until:
            assert closed_by_server(connect(server.port), 2)  # refused: the server is full
            time.sleep(0.2)
    finally:
        for sock in held:
            sock.close()
    with server.http() as http:
        listed = http.get(f"/sandboxes/{sandbox_id}")
        assert listed.status_code == 200, listed.text  # kept: nobody could have reached the server
        http.delete(f"/sandboxes/{sandbox_id}")
    assert "heartbeats_not_reaped" in server.log_path.read_text()
