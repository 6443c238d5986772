"""Wire models and quantities: what is accepted, what is rejected, and how."""

import pytest
from pydantic import ValidationError

from orchard.errors import SandboxLost, error_from_body
from orchard.models import ExecRequest, SandboxSpec
from orchard.quantities import parse_bytes, parse_cpu


def test_quantities():
    assert parse_cpu("4") == 4.0 and parse_cpu("2000m") == 2.0 and parse_cpu(1.5) == 1.5
    assert parse_bytes("16Gi") == 16 * 2**30 and parse_bytes("512M") == 512 * 10**6 and parse_bytes(1024) == 1024
    for bad in ("lots", "-1", "0"):
        with pytest.raises(ValueError):
            parse_cpu(bad)
    for bad in ("1Qi", "abc", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_null_means_default_and_unknown_fields_are_ignored():
    spec = SandboxSpec(image=None, block_network=None, env=None, whatever=1)
    assert spec.image == "host" and spec.block_network is True and spec.env == {}
    request = ExecRequest(command="ls", env=None, login_shell=None, wait=None, extra="x")
    assert request.env == {} and request.login_shell is False and request.effective_timeout() == 300.0


def test_list_commands_are_shell_joined():
    assert ExecRequest(command=["echo", "a b", "$HOME"]).command_text() == "echo 'a b' '$HOME'"


@pytest.mark.parametrize("body", [{"command": ""}, {"command": "x\0y"}, {"command": "ls", "timeout_seconds": 0},
                                  {"command": "ls", "job_id": "../x"}])
def test_invalid_exec_requests(body):
    with pytest.raises(ValidationError):
        ExecRequest(**body)


def test_errors_round_trip_by_type_name():
    error = SandboxLost("holder died")
    again = error_from_body(410, error.to_body())
    assert type(again) is SandboxLost and again.message == "holder died"
    assert type(error_from_body(410, {"detail": "gone"})) is SandboxLost
