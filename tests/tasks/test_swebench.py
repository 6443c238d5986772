"""SWE-bench and SWE-rebench instance files as tasks (small hand-written fixtures in the
datasets' own format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchard.tasks import (
    TaskFileError, Unsupported, instance_image, instance_to_task, load_swebench, load_swerebench, load_tasks,
    save_tasks,
)
from orchard.tasks.parsers import tests_passed as grade
from orchard.tasks.swebench import test_directives as directives_of

FIXTURES = Path(__file__).parent / "fixtures"


def instances(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


def test_image_names_follow_the_harness_scheme():
    assert instance_image("django__django-11099") == \
        "docker://docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert instance_image("Project-MONAI__MONAI-1234", "docker.io/swerebench", "arm64", "v2") == \
        "docker://docker.io/swerebench/sweb.eval.arm64.project-monai_1776_monai-1234:v2"


def test_swebench_pytest_instance(tmp_path):
    astropy, _django = load_swebench(FIXTURES / "swebench.jsonl")
    assert astropy.task_id == "astropy__astropy-12907" and astropy.split == "test"
    assert astropy.image == "docker://docker.io/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert astropy.workdir == "/testbed" and astropy.test_framework == "pytest" and not astropy.clean_run_required
    assert astropy.test_commands == [
        ". /opt/miniconda3/bin/activate && conda activate testbed && { pytest --no-header -rA --tb=no "
        "-p no:cacheprovider astropy/modeling/tests/test_separable.py; test $? -le 1; }"]
    assert astropy.fail_to_pass[0] == \
        "astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]"
    assert len(astropy.pass_to_pass) == 6  # decoded from the JSON-encoded string
    raw = instances("swebench.jsonl")[0]
    assert astropy.reference_patch == raw["patch"] and astropy.test_patch == raw["test_patch"]
    assert astropy.is_protected("astropy/modeling/tests/test_separable.py")
    assert not astropy.is_protected("astropy/modeling/separable.py")
    assert astropy.difficulty == "15 min - 1 hour" and astropy.tags == ["astropy/astropy"]
    assert astropy.metadata["base_commit"] == raw["base_commit"] and astropy.metadata["version"] == "4.3"
    assert astropy.metadata["environment_setup_commit"] == raw["environment_setup_commit"]
    save_tasks([astropy], tmp_path / "t.jsonl")
    assert load_tasks(tmp_path / "t.jsonl") == [astropy]


def test_swebench_django_runs_its_own_runner_and_ids_match_the_unittest_parser():
    django = load_swebench(FIXTURES / "swebench.jsonl")[1]
    assert django.test_framework == "unittest"
    assert "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 auth_tests.test_validators;" \
        in django.test_commands[0]
    assert django.fail_to_pass == ["auth_tests.test_validators.UsernameValidatorsTests.test_ascii_validator",
                                   "auth_tests.test_validators.UsernameValidatorsTests.test_unicode_validator"]
    assert "Named URLs should be reversible" in django.pass_to_pass  # docstring ids stay as they are
    log = ("Testing against Django installed in '/testbed/django'\n"
           "test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests) ... ok\n"
           "test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests) ... ok\n"
           "test_help_text (auth_tests.test_validators.MinimumLengthValidatorTest) ... ok\n"
           "test_validate (auth_tests.test_validators.UserAttributeSimilarityValidatorTest) ... ok\n"
           "test_reverse (urlpatterns.tests.ReverseTests)\nNamed URLs should be reversible ... ok\n"
           "test_unrelated (auth_tests.test_validators.Other) ... FAIL\n\n"
           "----------------------------------------------------------------------\n"
           "Ran 6 tests in 0.123s\n\nFAILED (failures=1)\nDestroying test database for alias 'default'...\n")
    resolved, details = grade(django, [log], [0])
    assert resolved, details["reason"]  # an unlisted failing test does not count against the fix
    resolved, details = grade(django, [log.replace("test_unicode_validator (auth_tests.test_validators."
                                                   "UsernameValidatorsTests) ... ok", "test_unicode_validator "
                                                   "(auth_tests.test_validators.UsernameValidatorsTests) ... FAIL")],
                              [0])
    assert not resolved and "test_unicode_validator" in details["reason"]


def test_django_directives_are_modules():
    patch = ("diff --git a/tests/forms_tests/tests/test_forms.py b/tests/forms_tests/tests/test_forms.py\n"
             "diff --git a/tests/forms_tests/templates/x.html b/tests/forms_tests/templates/x.html\n"
             "diff --git a/docs/ref.txt b/docs/ref.txt\n")
    assert directives_of("django/django", patch) == ["forms_tests.tests.test_forms"]
    assert directives_of("pallets/flask", patch) == ["tests/forms_tests/tests/test_forms.py",
                                                      "tests/forms_tests/templates/x.html"]


def test_swerebench_instances_use_their_own_image_and_test_command():
    tespy, cmd2 = load_swerebench(FIXTURES / "swerebench.jsonl")
    assert tespy.image == "docker://docker.io/swerebench/sweb.eval.x86_64.oemof_1776_tespy-653:latest"
    assert tespy.split == "train" and tespy.metadata["source"] == "swe-rebench"
    assert "-W ignore::DeprecationWarning tests/test_components/test_heat_exchangers.py;" in tespy.test_commands[0]
    assert tespy.fail_to_pass == ["tests/test_components/test_heat_exchangers.py::TestHeatExchangers::"
                                  "test_HeatExchanger_ttd_u_starting_value"]  # a plain list, not JSON text
    assert tespy.metadata["install_config"]["python"] == "3.9" and tespy.metadata["license_name"] == "MIT License"
    assert cmd2.image == "docker://docker.io/swerebench/sweb.eval.x86_64.python-cmd2_1776_cmd2-1201:latest"
    pinned = load_swerebench(FIXTURES / "swerebench.jsonl", namespace="registry.local:5000/mirror")[0]
    assert pinned.image == "docker://registry.local:5000/mirror/sweb.eval.x86_64.oemof_1776_tespy-653:latest"


def test_unsupported_instances_are_refused_or_skipped():
    with pytest.raises(TaskFileError, match=r"swebench_sympy.jsonl:2: sympy__sympy-20590: unsupported"):
        load_swebench(FIXTURES / "swebench_sympy.jsonl")
    assert [t.task_id for t in load_swebench(FIXTURES / "swebench_sympy.jsonl", skip_unsupported=True)] == \
        ["astropy__astropy-12907"]
    other = {**instances("swerebench.jsonl")[0]}
    other["install_config"] = {**other["install_config"], "log_parser": "parse_log_jest"}
    with pytest.raises(Unsupported, match="parse_log_jest"):
        instance_to_task(other, source="swe-rebench")


def write(tmp_path, *lines: str) -> Path:
    path = tmp_path / "instances.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("change,field,message", [
    (lambda d: d.pop("test_patch"), "test_patch", "field required"),
    (lambda d: d.update(patch=["not", "a", "string"]), "patch", "expected a string"),
    (lambda d: d.update(FAIL_TO_PASS="[not json"), "FAIL_TO_PASS", "not a JSON-encoded list"),
    (lambda d: d.update(FAIL_TO_PASS="[]"), "FAIL_TO_PASS", "no test ids"),
    (lambda d: d.update(PASS_TO_PASS=[1, 2]), "PASS_TO_PASS", "list of test ids"),
    (lambda d: d.update(instance_id="bad id!"), "task_id", "task_id must be"),
])
def test_bad_instances_name_the_line_and_field(tmp_path, change, field, message):
    good, bad = instances("swebench.jsonl")
    change(bad)
    with pytest.raises(TaskFileError) as info:
        load_swebench(write(tmp_path, json.dumps(good), "", json.dumps(bad)))
    assert info.value.line == 3 and info.value.field == field and message in info.value.message


def test_bad_json_in_an_instance_file(tmp_path):
    with pytest.raises(TaskFileError, match=r"instances.jsonl:1: not valid JSON"):
        load_swerebench(write(tmp_path, '{"instance_id": '))
    with pytest.raises(TaskFileError, match="expected a JSON object"):
        load_swerebench(write(tmp_path, '"just a string"'))
