"""The exec fast path (:mod:`orchard.fast_exec`) answers exactly as FastAPI's exec route.

One service behind two apps: the server's own, and the same app with the fast path taken
out (so FastAPI's route answers). The same requests to both: the same statuses and bodies,
for results and for every kind of error; auth, body limits and request ids still apply.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from orchard.fast_exec import FastExecRoute

KEY = "fast-path-key"


def _variable(body: dict) -> dict:
    """A job without what differs between two runs of one command."""
    return {k: v for k, v in body.items() if k not in ("job_id", "created_at", "started_at", "completed_at")}


@pytest.fixture(scope="module")
def answers(tmp_path_factory, agent_settings) -> dict[str, list[tuple[int, dict, dict]]]:
    """For each case, (status, JSON body, headers) from the fast app and from FastAPI's route."""
    from orchard.backends.local.launcher import stop_agent
    from orchard.server.app import create_app
    from orchard.server.config import ServerConfig
    from orchard.server.observability import Metrics
    from orchard.server.reconciler import Reconciler
    from orchard.server.service import ServerService

    root = tmp_path_factory.mktemp("fast-exec")
    settings = agent_settings.model_copy(update={"state_dir": Path(f"{agent_settings.state_dir}-fastexec")})
    agent = settings.model_dump(mode="json")
    config = ServerConfig(state=root / "server.db", max_body_bytes=1 << 20,
                          backend={"name": "local", "settings": {"agent": agent}})

    async def main() -> dict:
        service = ServerService(config, config.make_backend(), config.make_store(), Metrics())
        fast = create_app(service, Reconciler(service, config.reconciler), KEY)
        plain = create_app(service, Reconciler(service, config.reconciler), KEY)
        plain.user_middleware = [m for m in plain.user_middleware if m.cls is not FastExecRoute]
        assert len(plain.user_middleware) == len(fast.user_middleware) - 1
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     headers={"X-API-Key": KEY}, timeout=60) for app in (fast, plain)]
        try:
            created = await clients[0].post("/sandboxes", json={})
            assert created.status_code == 200, created.text
            sid = created.json()["sandbox_id"]
            exec_path = f"/sandboxes/{sid}/exec"
            cases: dict[str, dict] = {
                "result": {"json": {"command": "echo out; echo err >&2; exit 3", "wait": True}},
                "queued": {"json": {"command": "true"}},
                "list command": {"json": {"command": ["printf", "%s", "a b"], "wait": True}},
                "not json": {"content": b"{not json"},
                "wrong type": {"json": {"command": 5}},
                "bad env": {"json": {"command": "true", "env": {"A=B": "x"}}},
                "no command": {"json": {}},
                "unknown sandbox": {"json": {"command": "true"}, "path": "/sandboxes/sbx-nope/exec"},
                "bad idempotency key": {"json": {"command": "true"}, "headers": {"Idempotency-Key": "../x"}},
                "no key": {"json": {"command": "true"}, "headers": {"X-API-Key": ""}},
                "too large": {"content": b'{"command": "' + b"x" * (2 << 20) + b'"}'},
                "get": {"method": "GET"},
            }
            found: dict[str, list] = {}
            for name, case in cases.items():
                found[name] = []
                for client in clients:
                    answer = await client.request(case.get("method", "POST"), case.get("path", exec_path),
                                                  json=case.get("json"), content=case.get("content"),
                                                  headers=case.get("headers"))
                    found[name].append((answer.status_code, answer.json(), answer.headers))
            for n, client in enumerate(clients):  # one job id, two commands: a conflict, the same way
                first = await client.post(exec_path, json={"command": "true", "wait": True, "job_id": f"job-reused-{n}"})
                assert first.status_code == 200
            found["job id in use"] = []
            for n, client in enumerate(clients):
                answer = await client.post(exec_path, json={"command": "false", "job_id": f"job-reused-{n}"})
                found["job id in use"].append((answer.status_code, answer.json(), answer.headers))
            await clients[0].delete(f"/sandboxes/{sid}")
            return found
        finally:
            for client in clients:
                await client.aclose()
            await service.close()

    try:
        return asyncio.run(main())
    finally:
        stop_agent(settings)
        shutil.rmtree(settings.state_dir, ignore_errors=True)


CASES = ["result", "queued", "list command", "not json", "wrong type", "bad env", "no command", "unknown sandbox",
         "bad idempotency key", "no key", "too large", "get", "job id in use"]


@pytest.mark.parametrize("case", CASES)
def test_the_fast_path_answers_as_fastapis_route(answers, case):
    (fast_status, fast_body, fast_headers), (plain_status, plain_body, plain_headers) = answers[case]
    assert fast_status == plain_status
    if case in ("result", "list command"):
        assert _variable(fast_body) == _variable(plain_body)
    elif case == "queued":
        assert fast_body.keys() == plain_body.keys() and fast_body["status"] == plain_body["status"] == "queued"
    elif case == "job id in use":
        assert fast_body == json.loads(json.dumps(plain_body).replace("job-reused-1", "job-reused-0"))
    else:
        assert fast_body == plain_body
    assert fast_headers["content-type"] == plain_headers["content-type"] == "application/json"
    assert fast_headers.get("x-request-id") and plain_headers.get("x-request-id")


def test_the_cases_are_the_ones_that_matter(answers):
    """What each case got, so a case that stopped testing its error is noticed."""
    statuses = {case: answers[case][0][0] for case in CASES}
    assert statuses == {"result": 200, "queued": 200, "list command": 200, "not json": 422, "wrong type": 422,
                        "bad env": 422, "no command": 422, "unknown sandbox": 404, "bad idempotency key": 422,
                        "no key": 401, "too large": 413, "get": 405, "job id in use": 409}
    assert answers["result"][0][1]["exit_code"] == 3 and answers["result"][0][1]["stdout"] == "out\n"
    assert answers["list command"][0][1]["stdout"] == "a b"
    assert "idempotency-key" in json.dumps(answers["bad idempotency key"][0][1])
