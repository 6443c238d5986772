"""The published schema says what the server accepts: every request body it allows is
taken by the server's own models (a schema-driven client used to see most exec bodies
rejected). Generated deterministically (derandomize): the same cases every run."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis_jsonschema import from_schema

from orchard.models import ExecRequest, SandboxSpec
from orchard.quantities import CPU_PATTERN, QUANTITY_PATTERN
from orchard.server.openapi import openapi_json

SCHEMAS = json.loads(openapi_json())["components"]["schemas"]
# cpu, memory and disk: the schema gives their form as a pattern and their range in words
# (a range of quantities with units is no regular expression); checked separately below.
RANGED = ("cpu", "memory", "disk")
SPEC_SCHEMA = {**SCHEMAS["SandboxSpec"],
               "properties": {k: v for k, v in SCHEMAS["SandboxSpec"]["properties"].items() if k not in RANGED}}
DETERMINISTIC = settings(max_examples=150, derandomize=True, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@DETERMINISTIC
@given(from_schema(SCHEMAS["ExecRequest"]))
def test_every_exec_body_the_schema_allows_is_accepted(body):
    ExecRequest.model_validate(body)


@DETERMINISTIC
@given(from_schema(SPEC_SCHEMA))
def test_every_create_body_the_schema_allows_is_accepted(body):
    SandboxSpec.model_validate(body)


def test_resource_fields_publish_their_form_and_range():
    properties = SCHEMAS["SandboxSpec"]["properties"]
    assert properties["cpu"]["pattern"] == CPU_PATTERN and "0.01 to 1024" in properties["cpu"]["description"]
    for name in ("memory", "disk"):
        assert properties[name]["pattern"] == QUANTITY_PATTERN and "64Ti" in properties[name]["description"]
    pids = next(option for option in properties["pids"]["anyOf"] if option.get("type") == "integer")
    assert (pids["minimum"], pids["maximum"]) == (16, 4_194_304)
    for good in ({"cpu": "2", "memory": "16Gi", "disk": "10Gi"}, {"cpu": "500m", "memory": "512Mi", "disk": "1Mi"}):
        SandboxSpec.model_validate(good)


def test_raw_file_routes_declare_their_binary_bodies():
    paths = json.loads(openapi_json())["paths"]["/sandboxes/{sandbox_id}/files/raw"]
    assert "application/octet-stream" in paths["put"]["requestBody"]["content"]
    assert "application/octet-stream" in paths["get"]["responses"]["200"]["content"]
