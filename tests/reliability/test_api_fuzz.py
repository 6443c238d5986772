"""The served OpenAPI schema, fuzzed by schemathesis against a real `orchard serve` (local
backend, real sandboxes): no request, valid or not, gets a 5xx; what the schema allows is
accepted and what it forbids is rejected (the schema describes what the server takes).

Random path parameters name sandboxes that do not exist (404), so the operations on one
sandbox are fuzzed a second time against a live sandbox (``{sandbox_id}`` pinned to it):
there the agent's own handling of fuzzed commands, paths, patches and files is reached, and
the property is no 5xx. Quantities the schema allows by form but not by size (``cpu``,
``memory``, ``disk``: a range of numbers with units is no regular expression) must get a
422 naming the field.

Deterministic (derandomize): the same cases every run, so it never flakes; CI's short run is
a fixed regression set, the long one (``-m slow``) 200 cases per operation and mode.

    pytest -q tests/reliability/test_api_fuzz.py            # short: a few cases per operation
    pytest -q -m slow tests/reliability/test_api_fuzz.py    # long
"""

from __future__ import annotations

import json
from typing import Optional

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import negative_data_rejection, not_a_server_error, positive_data_acceptance

from orchard.quantities import parse_cpu, parse_disk, parse_memory
from orchard.server.openapi import openapi_json
from tests.server.conftest import API_KEY, ServerProcess


@schemathesis.check
def accepted_unless_the_image_is_refused(ctx, response, case):
    """positive_data_acceptance, except for ImageRejected: whether an image exists, lies in an
    allowed directory or registry is the deployment's policy, which no schema can say."""
    if response.status_code == 422 and (response.json().get("error") or {}).get("type") == "ImageRejected":
        return None
    return positive_data_acceptance(ctx, response, case)


CHECKS = [not_a_server_error, accepted_unless_the_image_is_refused, negative_data_rejection]
# the schema the server serves (tests/test_openapi_schema.py and the docs test keep it equal)
SCHEMA = schemathesis.openapi.from_dict(json.loads(openapi_json()))
OPERATIONS = {result.ok().label: result.ok() for result in SCHEMA.get_all_operations()}


@pytest.fixture(scope="module")
def fuzzed_server():
    process = ServerProcess(reconciler={"interval": 1, "heartbeat_ttl": 3600})
    yield process
    process.cleanup()


@pytest.fixture(scope="module")
def live_sandbox(fuzzed_server):
    """A sandbox the pinned cases act on (and may reset, snapshot, fill with files)."""
    answer = httpx.post(f"{fuzzed_server.url}/sandboxes", json={}, headers={"X-API-Key": API_KEY}, timeout=60)
    assert answer.status_code == 200 and answer.json()["status"] == "ready", answer.text
    return answer.json()["sandbox_id"]


# cpu, memory and disk publish their form as a pattern and their range in words (a range of
# quantities with units is no regular expression; tests/test_openapi_schema.py checks both).
RANGED = {"cpu": parse_cpu, "memory": parse_memory, "disk": parse_disk}


def out_of_range(case) -> Optional[str]:
    """The field of a schema-valid body whose quantity is out of range (a 422 must name it)."""
    if isinstance(case.body, dict):
        for name, parse in RANGED.items():
            if isinstance(case.body.get(name), str):
                try:
                    parse(case.body[name])
                except ValueError:
                    return name
    return None


def server_picks_the_id(case):
    if isinstance(case.body, dict) and case.operation.label == "POST /sandboxes":
        # a fuzzed id ("0") would give later cases a real sandbox whose answers depend on its
        # state (a cwd it lacks, a snapshot its image cannot take)
        case.body.pop("sandbox_id", None)
    return case


def fuzz(server: ServerProcess, label: str, mode: GenerationMode, examples: int, sandbox_id: Optional[str] = None) -> None:
    strategy = OPERATIONS[label].as_strategy(generation_mode=mode)
    if mode == GenerationMode.POSITIVE:  # a negative case's invalid id must stay: it may be what is invalid
        strategy = strategy.map(server_picks_the_id)
    headers = {"X-API-Key": API_KEY}

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case) -> None:
        if sandbox_id is not None:  # the agent's handling of a live sandbox: no 5xx is the property
            case.path_parameters = {**(case.path_parameters or {}), "sandbox_id": sandbox_id}
            case.call_and_validate(base_url=server.url, headers=headers, checks=[not_a_server_error], timeout=120)
            return
        field = out_of_range(case) if mode == GenerationMode.POSITIVE else None
        if field is not None:
            response = case.call(base_url=server.url, headers=headers, timeout=60)
            assert response.status_code == 422 and field in response.text, (field, case.body, response.text[:300])
            return
        case.call_and_validate(base_url=server.url, headers=headers, checks=CHECKS, timeout=60)

    run()


def has_invalid_input(operation) -> bool:
    """Whether a request can break the schema: a body, or a parameter that must be more than
    any string (a query string carries strings only: a "number" in it is a valid string)."""
    if operation.body:
        return True
    return any(not _any_string(p.definition.get("schema", {})) for p in operation.iter_parameters())


def _any_string(schema: dict) -> bool:
    if "anyOf" in schema:
        return all(_any_string(option) for option in schema["anyOf"])
    if schema.get("type") == "array":
        return _any_string(schema.get("items", {}))
    return schema.get("type") in (None, "string", "null") and not set(schema) & {"pattern", "enum", "maxLength",
                                                                              "minLength", "format", "const"}


# negative cases only where a request can break the schema (a bare string path parameter cannot)
CASES = [pytest.param(label, mode, id=f"{label}-{mode.value}") for label in sorted(OPERATIONS)
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode == GenerationMode.POSITIVE or has_invalid_input(OPERATIONS[label])]


# on a live sandbox: every operation on one sandbox but its delete (which would end the rest)
PINNED = [case for case in CASES if "{sandbox_id}" in case.values[0] and not case.values[0].startswith("DELETE")]


@pytest.mark.parametrize("label, mode", CASES)
def test_schema_short(fuzzed_server, label, mode):
    fuzz(fuzzed_server, label, mode, 5)


@pytest.mark.parametrize("label, mode", PINNED)
def test_schema_short_on_a_live_sandbox(fuzzed_server, live_sandbox, label, mode):
    fuzz(fuzzed_server, label, mode, 5, sandbox_id=live_sandbox)
    assert httpx.get(f"{fuzzed_server.url}/sandboxes/{live_sandbox}",  # and the sandbox survived it
                     headers={"X-API-Key": API_KEY}, timeout=60).json()["status"] == "ready"


@pytest.mark.slow
@pytest.mark.parametrize("label, mode", CASES)
def test_schema_long(fuzzed_server, label, mode):
    fuzz(fuzzed_server, label, mode, 200)


@pytest.mark.slow
@pytest.mark.parametrize("label, mode", PINNED)
def test_schema_long_on_a_live_sandbox(fuzzed_server, live_sandbox, label, mode):
    fuzz(fuzzed_server, label, mode, 200, sandbox_id=live_sandbox)
