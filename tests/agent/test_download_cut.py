"""A download whose sandbox is deleted under it: the client sees a cut body, and the agent's
log says so in one line, without uvicorn's "Exception in ASGI application" stack (an RL run
made hundreds: sandboxes deleted while their diff was being read)."""

from __future__ import annotations

import httpx
import pytest


def test_a_sandbox_deleted_mid_download_cuts_the_body_and_logs_one_line(pty_agent, kit_image, agent_settings):
    url, key, http = pty_agent
    log = agent_settings.agent_dir / "agent.log"
    before = log.stat().st_size
    sid = http.post("/sandboxes", json={"image": kit_image}).json()["sandbox_id"]
    size = 64 << 20  # far more than the socket buffers hold: the helper is still writing when the sandbox goes
    made = http.post(f"/sandboxes/{sid}/exec", json={"command": f"head -c {size} /dev/zero > big", "wait": True}).json()
    assert made["exit_code"] == 0, made
    received = 0
    with pytest.raises(httpx.RemoteProtocolError):
        with http.stream("GET", f"/sandboxes/{sid}/files/raw", params={"path": "big"}) as response:
            assert response.status_code == 200 and int(response.headers["content-length"]) == size
            chunks = response.iter_raw(1 << 16)
            received += len(next(chunks))
            with httpx.Client(transport=httpx.HTTPTransport(uds=url.removeprefix("unix://")), base_url="http://agent",
                              headers={"X-API-Key": key}, timeout=60) as other:
                assert other.delete(f"/sandboxes/{sid}").status_code in (200, 204)
            for chunk in chunks:
                received += len(chunk)
    assert 0 < received < size
    written = log.read_bytes()[before:].decode(errors="replace")
    assert f"sandbox {sid}: a download was cut short" in written, written[-3000:]
    assert "Exception in ASGI application" not in written, written[-3000:]
