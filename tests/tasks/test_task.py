"""The Task model and task files: validation, protected paths, JSONL round trips and the
errors a bad line gets (line number and field)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from orchard.errors import InvalidRequest, OrchardError
from orchard.tasks import Task, TaskFileError, load_tasks, parse_task_line, save_tasks

TEST_PATCH = """diff --git a/pkg/tests/test_new.py b/pkg/tests/test_new.py
new file mode 100644
--- /dev/null
+++ b/pkg/tests/test_new.py
@@ -0,0 +1,2 @@
+def test_x():
+    assert True
diff --git a/checks/verify_core.py b/checks/verify_core.py
--- a/checks/verify_core.py
+++ b/checks/verify_core.py
@@ -1 +1 @@
-old
+new
"""


def minimal(**overrides) -> dict:
    data = {"task_id": "demo__demo-1", "image": "host", "problem_statement": "fix it", "test_commands": ["true"]}
    data.update(overrides)
    return data


def test_a_minimal_task_gets_the_documented_defaults():
    task = Task(**minimal())
    assert task.workdir == "/workspace" and task.files == {} and task.setup == []
    assert task.test_framework == "exit_code" and task.clean_run_required
    assert task.split == "train" and task.time_limit_seconds == 1800 and task.command_timeout_seconds == 120
    assert task.reference_patch == "" and task.test_patch == "" and task.metadata == {}
    for path in ("tests/test_a.py", "test/x.py", "src/pkg/tests/helpers.py", "test_top.py", "pkg/test_mod.py",
                 "pkg/mod_test.py", "conftest.py", "pkg/conftest.py", "pytest.ini", "tox.ini", "setup.cfg",
                 ".git/config"):
        assert task.is_protected(path), path
    for path in ("pkg/core.py", "README.md", "pkg/testing_utils.py", "src/contest.py", "setup.py"):
        assert not task.is_protected(path), path


@pytest.mark.parametrize("path", ["pyproject.toml", ".pytest.ini", "pytest.toml", ".pytest.toml", "src/pyproject.toml",
                                  "src/pytest.ini", "pkg/.pytest.ini", "pkg/tox.ini", "pkg/setup.cfg"])
def test_every_file_pytest_reads_its_configuration_from_is_protected(path):
    """Each can say ``addopts = -p plugin`` (pytest looks for them upwards from its arguments)."""
    assert Task(**minimal()).is_protected(path)


@pytest.mark.parametrize("task_id", ["django__django-11099", "gen-3-00001-off_by_one", "a", "org/repo.v2/42",
                                     "x" * 200])
def test_valid_task_ids(task_id):
    assert Task(**minimal(task_id=task_id)).task_id == task_id


@pytest.mark.parametrize("task_id", ["", "-leading-dash", "has space", "semi;colon", "a//b", "a/../b", "a/./b",
                                     "trailing/", "x" * 201, "ünicode"])
def test_invalid_task_ids(task_id):
    with pytest.raises(ValidationError, match="task_id"):
        Task(**minimal(task_id=task_id))


@pytest.mark.parametrize("field,value", [
    ("image", "ubuntu:22.04"), ("image", "docker://"), ("image", "relative/dir"),
    ("workdir", "relative"), ("workdir", "/a/../b"),
    ("files", {"/etc/passwd": "x"}), ("files", {"../escape.py": "x"}), ("files", {".git/config": "x"}),
    ("files", {".": "x"}),
    ("test_commands", []), ("test_commands", ["  "]), ("test_framework", "nose"),
    ("time_limit_seconds", 0), ("command_timeout_seconds", -1), ("unknown_field", 1),
])
def test_invalid_fields_are_rejected(field, value):
    with pytest.raises(ValidationError, match=field):
        Task(**minimal(**{field: value}))


def test_listed_tests_need_a_framework_that_names_tests():
    with pytest.raises(ValidationError, match="exit_code"):
        Task(**minimal(fail_to_pass=["t"]))
    assert Task(**minimal(fail_to_pass=["t"], test_framework="pytest")).tests == ["t"]


def test_the_test_patch_files_become_protected():
    task = Task(**minimal(test_patch=TEST_PATCH))
    assert "checks/verify_core.py" in task.protected_paths  # not a test-looking name: added explicitly
    assert task.is_protected("checks/verify_core.py") and task.is_protected("pkg/tests/test_new.py")
    assert task.protected_paths.count("checks/verify_core.py") == 1
    again = Task.model_validate(task.model_dump())  # a round trip does not add it twice
    assert again.protected_paths == task.protected_paths
    custom = Task(**minimal(protected_paths=[], test_patch=TEST_PATCH))
    assert custom.protected_paths == ["pkg/tests/test_new.py", "checks/verify_core.py"]


def test_save_and_load_round_trip(tmp_path):
    tasks = [Task(**minimal(task_id=f"t-{i}", files={"a.py": "print('é')\n"}, metadata={"i": i}, tags=["x"]))
             for i in range(3)]
    path = tmp_path / "tasks.jsonl"
    assert save_tasks(tasks, path) == 3
    assert path.read_text(encoding="utf-8").count("\n") == 3
    assert load_tasks(path) == tasks
    assert not (tmp_path / "tasks.jsonl.tmp").exists()
    with pytest.raises(InvalidRequest, match="appears twice"):
        save_tasks([tasks[0], tasks[0]], tmp_path / "dupes.jsonl")
    assert not (tmp_path / "dupes.jsonl").exists() and not (tmp_path / "dupes.jsonl.tmp").exists()


def write_lines(tmp_path, *lines: str):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def load_error(path) -> TaskFileError:
    with pytest.raises(TaskFileError) as info:
        load_tasks(path)
    return info.value


def test_bad_json_names_the_line(tmp_path):
    error = load_error(write_lines(tmp_path, json.dumps(minimal()), "", '{"task_id": "x",'))
    assert error.line == 3 and "bad.jsonl:3" in error.message and "not valid JSON" in error.message
    assert isinstance(error, InvalidRequest) and isinstance(error, OrchardError)


def test_a_missing_field_names_line_and_field(tmp_path):
    data = minimal()
    del data["problem_statement"]
    error = load_error(write_lines(tmp_path, json.dumps(minimal(task_id="ok")), json.dumps(data)))
    assert (error.line, error.field) == (2, "problem_statement")
    assert "bad.jsonl:2" in error.message and "problem_statement: Field required" in error.message


def test_a_wrong_type_names_the_field(tmp_path):
    error = load_error(write_lines(tmp_path, json.dumps(minimal(setup="git init"))))
    assert (error.line, error.field) == (1, "setup")
    error = load_error(write_lines(tmp_path, json.dumps(minimal(files={"a.py": 3}))))
    assert error.field == "files.a.py"


def test_empty_test_commands_are_an_error(tmp_path):
    error = load_error(write_lines(tmp_path, json.dumps(minimal(test_commands=[]))))
    assert error.field == "test_commands" and "at least 1" in error.message


def test_non_object_lines_and_duplicate_ids(tmp_path):
    assert "expected a JSON object" in load_error(write_lines(tmp_path, "[1, 2]")).message
    error = load_error(write_lines(tmp_path, json.dumps(minimal()), json.dumps(minimal())))
    assert (error.line, error.field) == (2, "task_id") and "line 1" in error.message


def test_parse_task_line_reports_its_position():
    with pytest.raises(TaskFileError, match="stream:7: test_framework"):
        parse_task_line(json.dumps(minimal(test_framework="jest")), path="stream", line=7)
