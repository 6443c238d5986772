"""The key-theft reproduction of the security issue: a sandbox with network waits for the
server's port while `orchard serve` restarts (sandboxes outlive the server by design).

On main the sandbox lived in the host's network namespace: it took the port, the restarted
server exited "address already in use", and the next request with X-API-Key went to the
sandbox, which logged the key. Now the sandbox's loopback is its own.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from tests.server.conftest import API_KEY

SQUATTER = """
import socket, time
server = socket.socket()
while True:  # what an attacker would run: take the port the moment the server lets it go
    try:
        server.bind(("127.0.0.1", {port}))
        break
    except OSError:
        time.sleep(0.01)
server.listen(16)
open("/tmp/squatting", "w").write("yes")
while True:
    conn, _ = server.accept()
    with open("/tmp/stolen", "ab") as log:
        log.write(conn.recv(65536))
    conn.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\n{{}}")
    conn.close()
"""


def test_an_open_sandbox_cannot_take_the_servers_port_or_its_key(server_factory):
    server = server_factory()
    with server.client() as client:
        squatter = client.create(block_network=False)
        squatter.upload("/tmp/squat.py", SQUATTER.format(port=server.port).encode())
        squatter.exec("nohup python3 /tmp/squat.py >/dev/null 2>&1 &")
        deadline = time.monotonic() + 10
        while squatter.exec("cat /tmp/squatting 2>/dev/null").stdout != "yes" and time.monotonic() < deadline:
            time.sleep(0.1)  # its own loopback: the port is free there at once
        assert squatter.exec("cat /tmp/squatting").stdout == "yes"
        sandbox_id = squatter.id
    server.stop()
    server.start()  # raises if the port was taken (on main: "address already in use")
    with server.http() as http:
        listed = http.get("/sandboxes")
        assert listed.status_code == 200 and sandbox_id in listed.text  # the real server answered
        stolen = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "cat /tmp/stolen 2>/dev/null", "wait": True})
        assert stolen.status_code == 200 and API_KEY not in stolen.json()["stdout"]
        http.delete(f"/sandboxes/{sandbox_id}")


def test_the_server_refuses_to_start_on_a_port_that_is_taken(server_factory):
    server = server_factory()
    server.stop()
    with socket.socket() as taker:
        taker.bind(("127.0.0.1", server.port))
        taker.listen(1)
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "orchard.cli", "serve", "--config", str(server.config_path)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and time.monotonic() - started < 30
        assert "address already in use" in result.stderr and str(server.port) in result.stderr
