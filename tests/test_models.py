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


@pytest.mark.parametrize("field, value, allowed", [
    ("memory", "0.5", "16Mi and 64Ti"), ("memory", "1", "16Mi and 64Ti"), ("memory", "1.5", "16Mi and 64Ti"),
    ("memory", "65Ti", "16Mi and 64Ti"), ("memory", "1e9", "16Mi and 64Ti"), ("memory", "nan", "16Mi and 64Ti"),
    ("disk", "0.5", "1Mi and 64Ti"), ("disk", "1Ki", "1Mi and 64Ti"), ("disk", "inf", "1Mi and 64Ti"),
    ("cpu", "inf", "0.01 and 1024"), ("cpu", "nan", "0.01 and 1024"), ("cpu", "1e308", "0.01 and 1024"),
    ("cpu", "1e-9", "0.01 and 1024"), ("cpu", 0.0001, "0.01 and 1024"), ("cpu", "5m", "0.01 and 1024"),
    ("cpu", "1025", "0.01 and 1024"), ("cpu", "1_0", "0.01 and 1024"), ("cpu", True, "0.01 and 1024"),
    ("pids", 1, "16 and 4194304"), ("pids", 15, "16 and 4194304"), ("pids", 0, "16 and 4194304"),
    ("pids", 1 << 23, "16 and 4194304"),
])
def test_resource_values_out_of_range_name_the_field_and_the_range(field, value, allowed):
    with pytest.raises(ValidationError) as caught:
        SandboxSpec(**{field: value})
    (error,) = caught.value.errors()
    assert error["loc"] == (field,) and allowed in error["msg"] and len(error["msg"]) < 160, error


def test_resource_values_in_the_original_forms_are_kept():
    spec = SandboxSpec(cpu="500m", memory="16Gi", disk="10Gi", pids=16)
    assert (spec.cpu, spec.memory, spec.disk, spec.pids) == ("500m", "16Gi", "10Gi", 16)
    for cpu in ("4", "2000m", "10m", "1024", "0.5", 2, 1.5):
        SandboxSpec(cpu=cpu)
    for size in ("512M", "16Mi", "1.5Gi", "64Ti", "1073741824", 1073741824):
        assert SandboxSpec(memory=size, disk=size).memory == str(size)
    assert SandboxSpec(disk="1Mi").disk == "1Mi" and SandboxSpec(pids="4096").pids == 4096
    assert SandboxSpec(pids=4_194_304).pids == 4_194_304


def test_quantities_reject_non_finite_numbers_and_fractions_of_a_byte():
    assert parse_cpu("10m") == 0.01 and parse_cpu("1024") == 1024.0
    for bad in ("inf", "nan", "1e308", "1e-9", "5m", "1025", "", None):
        with pytest.raises(ValueError):
            parse_cpu(bad)
    assert parse_bytes("1.5Ki") == 1536 and parse_bytes("0.5Gi") == 2**29
    for bad in ("0.5", "0.1Ki", "1e3", "inf", "9" * 100):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_the_agents_default_limits_are_in_range():
    from orchard.agent.settings import AgentSettings
    from orchard.quantities import check_pids, parse_disk, parse_memory

    settings = AgentSettings()
    assert parse_memory(settings.default_memory) == 4 * 2**30 and parse_disk(settings.default_disk) == 10 * 2**30
    assert check_pids(settings.default_pids) == 4096


@pytest.mark.parametrize("env", [{"A=B": "x"}, {"": "x"}, {"A\0B": "x"}, {"A": "x\0y"}])
def test_env_names_execve_cannot_pass_are_rejected(env):
    for model, extra in ((SandboxSpec, {}), (ExecRequest, {"command": "true"})):
        with pytest.raises(ValidationError) as caught:
            model(env=env, **extra)
        (error,) = caught.value.errors()
        assert error["loc"] == ("env",) and "env" in error["msg"]
    assert ExecRequest(command="true", env={"A": "b=c", "_x1": ""}).env == {"A": "b=c", "_x1": ""}


def test_job_id_rule():
    from orchard.models import valid_job_id

    for good in ("a", "job-0123456789abcdef", "retry.me_1", "x" * 63):
        assert valid_job_id(good) and ExecRequest(command="ls", job_id=good).job_id == good
    for bad in ("", ".", "..", "-x", "a/b", "a b", "a\0", "x" * 64, None, 5):
        assert not valid_job_id(bad)
