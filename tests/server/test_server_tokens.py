"""Per-sandbox agent tokens die with their sandbox."""

from __future__ import annotations

import httpx


def test_a_token_does_not_open_a_later_sandbox_with_the_same_id(server):
    with server.http() as http:
        first = http.post("/sandboxes", json={"sandbox_id": "reused-id"}).json()
        http.delete("/sandboxes/reused-id")
        second = http.post("/sandboxes", json={"sandbox_id": "reused-id"}).json()
        try:
            assert first["agent_token"] != second["agent_token"]
            transport = httpx.HTTPTransport(uds=second["agent_url"].removeprefix("unix://"))
            with httpx.Client(transport=transport, base_url="http://agent") as agent:
                body = {"command": "echo hi", "wait": True}
                stale = agent.post("/sandboxes/reused-id/exec", json=body, headers={"X-API-Key": first["agent_token"]})
                assert stale.status_code == 401
                fresh = agent.post("/sandboxes/reused-id/exec", json=body, headers={"X-API-Key": second["agent_token"]})
                assert fresh.json()["stdout"] == "hi\n"
        finally:
            http.delete("/sandboxes/reused-id")
