"""What a real `orchard serve` refuses at the edge, and how: resource values, env names, job ids
and idempotency keys get 422 naming the field (never a 503 with a Python exception, a sandbox
without its limit, or a job record stuck in "queued"); streams fail before their first byte."""

from __future__ import annotations

import inspect
import json

import httpx
import pytest

import orchard.routes


def _sandbox_count(http: httpx.Client) -> int:
    return len(http.get("/sandboxes").json()["sandboxes"])


BAD_RESOURCES = [
    ({"memory": "0.5"}, "memory", "16Mi and 64Ti"), ({"memory": "1"}, "memory", "16Mi and 64Ti"),
    ({"disk": "0.5"}, "disk", "1Mi and 64Ti"),
    ({"cpu": "inf"}, "cpu", "0.01 and 1024"), ({"cpu": "nan"}, "cpu", "0.01 and 1024"),
    ({"cpu": "1e308"}, "cpu", "0.01 and 1024"), ({"cpu": "1e-9"}, "cpu", "0.01 and 1024"),
    ({"cpu": 0.0001}, "cpu", "0.01 and 1024"), ({"pids": 1}, "pids", "16 and 4194304"),
]


def test_resource_values_get_422_naming_the_field_and_the_range(server):
    with server.http() as http:
        before = _sandbox_count(http)
        for body, field, allowed in BAD_RESOURCES:
            answer = http.post("/sandboxes", json=body)
            assert answer.status_code == 422, (body, answer.text)
            detail = answer.json()["detail"]
            assert [d["loc"] for d in detail] == [["body", field]], (body, detail)
            message = answer.json()["error"]["message"]
            assert message.startswith(f"body.{field}: ") and allowed in message and "Error:" not in message, message
        assert _sandbox_count(http) == before  # nothing half-created
        created = http.post("/sandboxes", json={"cpu": "500m", "memory": "512M", "disk": "64Mi", "pids": 64})
        assert created.status_code == 200, created.text
        sid = created.json()["sandbox_id"]
        try:
            job = http.post(f"/sandboxes/{sid}/exec", json={"command": "echo ok", "wait": True}).json()
            assert job["stdout"] == "ok\n"
        finally:
            http.delete(f"/sandboxes/{sid}")


def test_env_names_with_equals_or_nul_are_refused_at_create_and_exec(server):
    with server.http() as http:
        for env in ({"A=B": "x"}, {"": "x"}, {"A": "x\0y"}):
            answer = http.post("/sandboxes", json={"env": env})
            assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "env"], answer.text
        sid = http.post("/sandboxes", json={"env": {"GREETING": "a=b"}}).json()["sandbox_id"]
        try:
            answer = http.post(f"/sandboxes/{sid}/exec", json={"command": "true", "env": {"X=Y": "1"}, "wait": True})
            assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "env"], answer.text
            job = http.post(f"/sandboxes/{sid}/exec", json={"command": "echo $GREETING", "wait": True}).json()
            assert job["stdout"] == "a=b\n", job
        finally:
            http.delete(f"/sandboxes/{sid}")


def test_refused_requests_leave_no_queued_job_behind(server):
    with server.http() as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        try:
            bad_key = http.post(f"/sandboxes/{sid}/exec", json={"command": "true"}, headers={"Idempotency-Key": ".."})
            assert bad_key.status_code == 422 and bad_key.json()["detail"][0]["loc"] == ["header", "idempotency-key"]
            assert http.get("/jobs/%2E%2E").status_code == 404
            # valid key, but the agent refuses the request (no such cwd): no record may stay "queued"
            refused = http.post(f"/sandboxes/{sid}/exec", json={"command": "true", "cwd": "missing"},
                                headers={"Idempotency-Key": "refused-1"})
            assert refused.status_code == 422, refused.text
            assert http.get("/jobs/refused-1").status_code == 404
            # the key is still free for a request the agent takes
            taken = http.post(f"/sandboxes/{sid}/exec", json={"command": "echo took"},
                              headers={"Idempotency-Key": "refused-1"})
            assert taken.status_code == 200 and taken.json()["job_id"] == "refused-1", taken.text
            done = http.get("/jobs/refused-1/wait", params={"timeout": 10}).json()
            assert done["stdout"] == "took\n" and done["status"] == "succeeded"
            assert http.post(f"/sandboxes/{sid}/exec", json={"command": "true"},
                             headers={"Idempotency-Key": ""}).status_code == 200  # empty: no key, as before
        finally:
            http.delete(f"/sandboxes/{sid}")


def test_the_agent_refuses_a_bad_idempotency_key_on_the_direct_path(server):
    with server.http() as http:
        sandbox = http.post("/sandboxes", json={}).json()
        sid = sandbox["sandbox_id"]
        try:
            transport = httpx.HTTPTransport(uds=sandbox["agent_url"].removeprefix("unix://"))
            with httpx.Client(transport=transport, base_url="http://agent",
                              headers={"X-API-Key": sandbox["agent_token"]}) as agent:
                for key in ("..", "a/b", "x" * 64):
                    answer = agent.post(f"/sandboxes/{sid}/exec", json={"command": "true"},
                                        headers={"Idempotency-Key": key})
                    assert answer.status_code == 422 and "Idempotency-Key" in answer.text, (key, answer.text)
                good = agent.post(f"/sandboxes/{sid}/exec", json={"command": "true"},
                                  headers={"Idempotency-Key": "ok-1"})
                assert good.status_code == 200 and good.json()["job_id"] == "ok-1"
        finally:
            http.delete(f"/sandboxes/{sid}")


@pytest.mark.parametrize("job_id", ["%2E%2E", "%2E", "a%20b", "x" * 300, "%00", "a:b", "-x"])
def test_odd_job_ids_are_not_found_never_500(server, job_id):
    with server.http() as http:
        for path in (f"/jobs/{job_id}", f"/jobs/{job_id}/wait"):
            answer = http.get(path, params={"timeout": 0})
            assert answer.status_code in (404, 422), (path, answer.status_code, answer.text)


def test_stream_errors_come_before_the_first_byte(server):
    with server.http() as http:
        unknown = http.post("/sandboxes/no-such-sandbox/exec/stream", json={"command": "true"})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "SandboxNotFound"
        assert http.post("/sandboxes/no-such-sandbox/exec/stream", json={}).status_code == 422
        mine = http.post("/sandboxes", json={}).json()["sandbox_id"]
        other = http.post("/sandboxes", json={}).json()["sandbox_id"]
        try:
            bad_key = http.post(f"/sandboxes/{mine}/exec/stream", json={"command": "true"},
                                headers={"Idempotency-Key": "a/b"})
            assert bad_key.status_code == 422 and bad_key.json()["detail"][0]["loc"] == ["header", "idempotency-key"]
            bad_env = http.post(f"/sandboxes/{mine}/exec/stream", json={"command": "true", "env": {"A=B": "1"}})
            assert bad_env.status_code == 422
            secret = http.post(f"/sandboxes/{other}/exec",
                               json={"command": "echo secret-of-other", "job_id": "theirs-1", "wait": True}).json()
            assert secret["stdout"] == "secret-of-other\n"
            for route in ("exec", "exec/stream"):  # 409, and nothing about the other job in it
                clash = http.post(f"/sandboxes/{mine}/{route}", json={"command": "true", "job_id": "theirs-1"})
                assert clash.status_code == 409 and clash.json()["error"]["type"] == "SandboxConflict", clash.text
                assert other not in clash.text and "secret-of-other" not in clash.text
            events = [json.loads(line) for line in http.post(
                f"/sandboxes/{mine}/exec/stream", json={"command": "echo x >> runs; echo streamed", "job_id": "mine-1"},
            ).text.splitlines()]
            assert events[-1]["type"] == "exit" and events[-1]["job"]["stdout"] == "streamed\n"
            assert http.get("/jobs/mine-1").json()["status"] == "succeeded"
            again = [json.loads(line) for line in http.post(
                f"/sandboxes/{mine}/exec/stream", json={"command": "echo x >> runs; echo streamed", "job_id": "mine-1"},
            ).text.splitlines()]
            assert again[-1]["job"]["job_id"] == "mine-1"  # replayed, never run twice
            runs = http.post(f"/sandboxes/{mine}/exec", json={"command": "cat runs", "wait": True}).json()
            assert runs["stdout"] == "x\n"
            piped = http.post(f"/sandboxes/{mine}/exec/stream", json={"command": "cat", "stdin": "piped\n"})
            assert json.loads(piped.text.splitlines()[-1])["job"]["stdout"] == "piped\n"
        finally:
            http.delete(f"/sandboxes/{mine}")
            http.delete(f"/sandboxes/{other}")


def _route_awaits_stream() -> bool:
    return "_value(ops.stream(" in inspect.getsource(orchard.routes.add_sandbox_routes)


# Needs orchard/routes.py to await ``ops.stream(...)`` before it builds the StreamingResponse
# (``events = await _value(ops.stream(...))``): the server's stream hands the command to the
# agent when awaited, so the agent's refusal becomes the status. Until then the route sends 200
# first and the refusal cuts the body. The marker switches itself off once routes.py has it.
@pytest.mark.xfail(not _route_awaits_stream(), reason="orchard/routes.py does not await ops.stream yet",
                   raises=(AssertionError, httpx.HTTPError), strict=True)
def test_stream_refused_by_the_agent_is_an_error_status_not_a_cut_body(server):
    with server.http() as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        try:
            refused = http.post(f"/sandboxes/{sid}/exec/stream", json={"command": "true", "cwd": "missing"})
            assert refused.status_code == 422 and "cwd" in refused.json()["error"]["message"], refused.text
        finally:
            http.delete(f"/sandboxes/{sid}")
