"""Bodies through the server: files stream end to end, oversized requests get 413."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.errors import PayloadTooLarge

MiB = 1 << 20


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise LookupError(pid)


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS


def test_raw_files_stream_through_the_server_without_holding_them(server_factory):
    server = server_factory()
    payload = bytes(range(256)) * (1 << 20)  # 256 MiB
    with server.client() as client, client.create("host") as sandbox:
        server_pid = server.process.pid
        reset_peak(server_pid)
        before = peak_rss(server_pid)
        assert sandbox.upload("/tmp/big.bin", payload) == len(payload)
        assert sandbox.exec("stat -c %s /tmp/big.bin").stdout.strip() == str(len(payload))
        with server.http() as http, http.stream("GET", f"/sandboxes/{sandbox.id}/files/raw",
                                                params={"path": "/tmp/big.bin"}) as response:
            received = 0
            for chunk in response.iter_bytes():
                received += len(chunk)
        assert received == len(payload)
        grew = peak_rss(server_pid) - before
        assert grew < 64 * MiB, f"the server held {grew / MiB:.0f} MiB for a 256 MiB file"


def test_a_sandbox_deleted_mid_download_cuts_the_body_and_each_log_says_so_in_one_line(server_factory):
    """The agent's stream is cut under the server: the client's body is cut, and neither the
    server's log nor the agent's holds uvicorn's "Exception in ASGI application" stack."""
    import httpx

    server = server_factory()
    size = 64 * MiB  # far more than the sockets buffer: the agent is still sending when the sandbox goes
    with server.client() as client:
        sandbox = client.create("host")
        assert sandbox.exec(f"head -c {size} /dev/zero > /tmp/big").exit_code == 0
        received = 0
        with pytest.raises(httpx.RemoteProtocolError), server.http() as http:
            with http.stream("GET", f"/sandboxes/{sandbox.id}/files/raw", params={"path": "/tmp/big"}) as response:
                assert response.status_code == 200 and int(response.headers["content-length"]) == size
                chunks = response.iter_raw(1 << 16)
                received += len(next(chunks))
                sandbox.delete()
                for chunk in chunks:
                    received += len(chunk)
        assert 0 < received < size
    agent_log = (server.agent_state / "agent" / "agent.log").read_text(errors="replace")
    server_log = server.log_path.read_text(errors="replace")
    assert f"sandbox {sandbox.id}: a download was cut short" in server_log, server_log[-3000:]
    for log in (server_log, agent_log):
        assert "Exception in ASGI application" not in log, log[-3000:]


def test_oversized_json_bodies_get_413_naming_the_limit(server_factory):
    server = server_factory(max_body_bytes=2 * MiB)
    with server.client() as client, client.create("host") as sandbox:
        with server.http() as http:
            response = http.post(f"/sandboxes/{sandbox.id}/exec", json={"command": "x" * (3 * MiB)})
            assert response.status_code == 413
            assert response.json()["error"]["type"] == "PayloadTooLarge"
            assert "2097152" in response.json()["error"]["message"]

            def chunked():  # no Content-Length: counted as it arrives
                yield b'{"command": "'
                for _ in range(3):
                    yield b"y" * MiB
                yield b'"}'

            response = http.post(f"/sandboxes/{sandbox.id}/exec", content=chunked(),
                                 headers={"content-type": "application/json"})
            assert response.status_code == 413
        with pytest.raises(PayloadTooLarge):
            sandbox.exec("echo " + "z" * (3 * MiB))
        assert sandbox.exec("echo fine").stdout == "fine\n"  # nothing else broke


def test_raw_upload_limit_is_configurable(server_factory):
    server = server_factory(max_upload_bytes=1 * MiB)
    with server.client() as client, client.create("host") as sandbox:
        with pytest.raises(PayloadTooLarge):
            sandbox.upload("big.bin", b"\0" * (2 * MiB))
        with server.http() as http:
            response = http.put(f"/sandboxes/{sandbox.id}/files/raw", params={"path": "small.bin"}, content=b"ok")
            assert response.status_code == 200
        assert sandbox.download("small.bin") == b"ok"


def test_chunked_oversized_bodies_get_413_on_every_json_route(server_factory):
    """Routes whose body FastAPI parses answered 400 "error parsing the body" (and hung)."""
    server = server_factory(max_body_bytes=2 * MiB)
    with server.client() as client, client.create("host") as sandbox, server.http() as http:
        def chunked():
            yield b'{"image": "host", "labels": {"x": "'
            for _ in range(3):
                yield b"y" * MiB
            yield b'"}}'

        for path in ("/sandboxes", f"/sandboxes/{sandbox.id}/files", f"/sandboxes/{sandbox.id}/apply_patch",
                     f"/sandboxes/{sandbox.id}/exec/stream"):
            response = http.post(path, content=chunked(), headers={"content-type": "application/json"})
            assert response.status_code == 413, (path, response.status_code, response.text[:200])
            assert response.json()["error"]["type"] == "PayloadTooLarge"
        assert sandbox.exec("echo fine").stdout == "fine\n"


def test_lone_surrogates_are_a_422_not_a_500_or_a_broken_sandbox(server):
    """JSON may carry "\\ud800": it made create answer 500 yet leave the sandbox behind, or
    accept an env that broke every later command."""
    with server.http() as http:
        before = {s["sandbox_id"] for s in http.get("/sandboxes").json()["sandboxes"]}
        for body in ('{"image": "host", "labels": {"A": "\\ud800"}}', '{"image": "host", "env": {"A": "\\ud800"}}',
                     '{"image": "host", "env": {"\\udfff": "x"}}'):
            response = http.post("/sandboxes", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 422, (body, response.text[:300])
            assert "UTF-8" in response.json()["error"]["message"]
        assert {s["sandbox_id"] for s in http.get("/sandboxes").json()["sandboxes"]} == before
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        try:
            for route in ("exec", "exec/stream"):
                response = http.post(f"/sandboxes/{sid}/{route}", content='{"command": "echo \\ud800"}',
                                     headers={"content-type": "application/json"})
                assert response.status_code == 422, (route, response.text[:300])
        finally:
            http.delete(f"/sandboxes/{sid}")
