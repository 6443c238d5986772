"""The served OpenAPI schema, fuzzed by schemathesis against a real `orchard serve` (local
backend, real sandboxes): no request, valid or not, gets a 5xx; what the schema allows is
accepted and what it forbids is rejected (the schema describes what the server takes).

Deterministic (derandomize): the same cases every run, so it never flakes.

    pytest -q tests/reliability/test_api_fuzz.py            # short: a few cases per operation
    pytest -q -m slow tests/reliability/test_api_fuzz.py    # long
"""

from __future__ import annotations

import json

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
    process = ServerProcess(reconciler={"interval": 1, "heartbeat_ttl": 30})
    yield process
    process.cleanup()


# cpu, memory and disk publish their form as a pattern and their range in words (a range of
# quantities with units is no regular expression; tests/test_openapi_schema.py checks both):
# a schema-valid value out of range is replaced by one in range before a positive case is sent.
RANGED = {"cpu": (parse_cpu, "1"), "memory": (parse_memory, "256Mi"), "disk": (parse_disk, "64Mi")}


def in_range(case):
    if isinstance(case.body, dict) and case.operation.label == "POST /sandboxes":
        # the server picks the id: a fuzzed id ("0") would give later cases a real sandbox whose
        # answers depend on its state (a cwd it lacks, a snapshot its image cannot take)
        case.body.pop("sandbox_id", None)
    if isinstance(case.body, dict):
        for name, (parse, fallback) in RANGED.items():
            if isinstance(case.body.get(name), str):
                try:
                    parse(case.body[name])
                except ValueError:
                    case.body[name] = fallback
    return case


def fuzz(server: ServerProcess, label: str, mode: GenerationMode, examples: int) -> None:
    strategy = OPERATIONS[label].as_strategy(generation_mode=mode)
    if mode == GenerationMode.POSITIVE:
        strategy = strategy.map(in_range)

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case) -> None:
        case.call_and_validate(base_url=server.url, headers={"X-API-Key": API_KEY}, checks=CHECKS, timeout=60)

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


@pytest.mark.parametrize("label, mode", CASES)
def test_schema_short(fuzzed_server, label, mode):
    fuzz(fuzzed_server, label, mode, 5)


@pytest.mark.slow
@pytest.mark.parametrize("label, mode", CASES)
def test_schema_long(fuzzed_server, label, mode):
    fuzz(fuzzed_server, label, mode, 200)
