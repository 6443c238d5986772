"""A software-engineering task: a repository in a sandbox, an issue, and the tests that judge a fix.

Tasks cross files (generated suites, converted SWE-bench instances, difficulty-filtered
training sets), so they are strict pydantic models stored one per line in JSONL, and a bad
line is reported with its number and the field at fault.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchard.errors import InvalidRequest
from orchard.tasks.patches import is_protected, patch_files

TestFramework = Literal["pytest", "unittest", "exit_code"]
TASK_ID_RULE = ("1-200 characters of A-Z a-z 0-9 . _ / -, starting with a letter or digit, "
                "without empty, '.' or '..' path segments")
_TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")

# Files whose change would let a diff pass by weakening the judge instead of fixing the code:
# tests, and every file pytest reads its configuration from (``addopts = -p plugin`` loads
# code into the runner), at the top or nested (pytest looks upwards from its arguments).
# ``pyproject.toml`` and ``setup.cfg`` are sometimes part of a real fix; a diff touching
# them is refused all the same (the grader's integrity first). ``setup.py`` is not
# protected: no test runner here reads it.
DEFAULT_PROTECTED_PATHS: tuple[str, ...] = (
    "tests/*", "test/*", "testing/*", "*/tests/*", "*/test/*",
    "test_*.py", "*/test_*.py", "*_test.py", "tests.py", "*/tests.py",
    "conftest.py", "*/conftest.py",
    "pytest.ini", "*/pytest.ini", ".pytest.ini", "*/.pytest.ini", "pytest.toml", "*/pytest.toml",
    ".pytest.toml", "*/.pytest.toml", "pyproject.toml", "*/pyproject.toml", "tox.ini", "*/tox.ini",
    "setup.cfg", "*/setup.cfg", "noxfile.py",
    ".git/*", ".github/*",
)


class TaskFileError(InvalidRequest):
    """A task file has a line that is not a valid task (the message names the line and field)."""

    def __init__(self, message: str, path: str = "", line: int = 0, field: str = "") -> None:
        super().__init__(message)
        self.path, self.line, self.field = path, line, field


class Task(BaseModel):
    """A repository state, an issue about it, and how to tell whether a change resolves it."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(description=TASK_ID_RULE)
    image: str = Field(min_length=1, max_length=4096,
                       description="'host', an absolute root-filesystem directory, or docker://REF")
    problem_statement: str = Field(min_length=1, description="the issue the agent is asked to resolve")
    workdir: str = Field("/workspace", description="absolute path of the repository inside the sandbox")
    files: dict[str, str] = Field(default_factory=dict,
                                  description="text files (paths relative to workdir) written before setup")
    setup: list[str] = Field(default_factory=list,
                             description="shell commands run once in workdir; they leave a git repository "
                                         "whose HEAD is the starting state")
    test_commands: list[str] = Field(min_length=1, description="run in workdir at grading; all must exit 0")
    test_framework: TestFramework = Field("exit_code", description="how per-test results are read from output")
    clean_run_required: bool = Field(True, description="every test a run reports must pass (its summary says no "
                                                       "failures); False: only the listed ids are judged, as "
                                                       "SWE-bench does, but each run must still end with its summary")
    fail_to_pass: list[str] = Field(default_factory=list, description="test ids the fix must make pass")
    pass_to_pass: list[str] = Field(default_factory=list, description="test ids that must keep passing")
    test_patch: str = Field("", description="diff applied at grading, after the agent's diff")
    protected_paths: list[str] = Field(default_factory=lambda: list(DEFAULT_PROTECTED_PATHS),
                                       description="globs of files the agent's diff may not touch, or it "
                                                   "is refused (the test patch's files are added)")
    reference_patch: str = Field("", description="a known fix (gold patch)")
    difficulty: Optional[str] = None
    tags: list[str] = Field(default_factory=list)
    split: str = Field("train", min_length=1)
    time_limit_seconds: float = Field(1800.0, gt=0, description="budget of the whole rollout")
    command_timeout_seconds: float = Field(120.0, gt=0, description="budget of one command")
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("task_id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        segments = value.split("/")
        if not _TASK_ID.fullmatch(value) or any(s in ("", ".", "..") for s in segments):
            raise ValueError(f"task_id must be {TASK_ID_RULE}; got {value[:60]!r}")
        return value

    @field_validator("image")
    @classmethod
    def _check_image(cls, value: str) -> str:
        if value == "host" or value.startswith("/") or (value.startswith("docker://") and len(value) > 9):
            return value
        raise ValueError(f"image must be 'host', an absolute directory or docker://REF; got {value[:60]!r}")

    @field_validator("workdir")
    @classmethod
    def _check_workdir(cls, value: str) -> str:
        if not value.startswith("/") or ".." in PurePosixPath(value).parts:
            raise ValueError(f"workdir must be an absolute path without '..'; got {value!r}")
        return value

    @field_validator("files")
    @classmethod
    def _check_files(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            parts = PurePosixPath(name).parts
            if not parts or name.startswith("/") or ".." in parts or parts[0] == ".git":
                raise ValueError(f"files: {name!r} must be a relative path inside the repository")
        return value

    @field_validator("test_commands")
    @classmethod
    def _check_commands(cls, value: list[str]) -> list[str]:
        if any(not command.strip() for command in value):
            raise ValueError("test_commands must not hold blank commands")
        return value

    @model_validator(mode="after")
    def _finish(self) -> "Task":
        if (self.fail_to_pass or self.pass_to_pass) and self.test_framework == "exit_code":
            raise ValueError("fail_to_pass/pass_to_pass need a test_framework that names tests "
                             "(pytest or unittest), not exit_code")
        for path in patch_files(self.test_patch):
            if not is_protected(path, self.protected_paths):
                self.protected_paths.append(path)
        return self

    def is_protected(self, path: str) -> bool:
        """Whether the agent's diff may not touch ``path`` (a diff that does is refused at grading)."""
        return is_protected(path, self.protected_paths)

    @property
    def tests(self) -> list[str]:
        """Every test id the grader checks: fail_to_pass then pass_to_pass."""
        return self.fail_to_pass + self.pass_to_pass


def _field_of(error: dict) -> str:
    return ".".join(str(part) for part in error["loc"]) or "(line)"


def parse_task_line(text: str, *, path: str = "<string>", line: int = 1) -> Task:
    """One JSONL line as a task; errors name the file, line and field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{path}:{line}: not valid JSON ({exc.msg} at column {exc.colno})",
                            path, line) from None
    if not isinstance(data, dict):
        raise TaskFileError(f"{path}:{line}: expected a JSON object, got {type(data).__name__}", path, line)
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        problems = "; ".join(f"{_field_of(e)}: {e['msg']}" for e in exc.errors())
        raise TaskFileError(f"{path}:{line}: {problems}", path, line, _field_of(first)) from None


def load_tasks(path: Union[str, Path]) -> list[Task]:
    """Tasks of a JSONL file (blank lines skipped); ids must be unique within the file."""
    path = Path(path)
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            task = parse_task_line(text, path=str(path), line=number)
            if task.task_id in seen:
                raise TaskFileError(f"{path}:{number}: task_id {task.task_id!r} already used on line "
                                    f"{seen[task.task_id]}", str(path), number, "task_id")
            seen[task.task_id] = number
            tasks.append(task)
    return tasks


def save_tasks(tasks: Iterable[Task], path: Union[str, Path]) -> int:
    """Write tasks as JSONL (one compact object per line, written whole then renamed); the count.
    Ids must be unique, as :func:`load_tasks` requires."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    seen: set[str] = set()
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            for task in tasks:
                if task.task_id in seen:
                    raise InvalidRequest(f"{path}: task_id {task.task_id!r} appears twice")
                seen.add(task.task_id)
                handle.write(json.dumps(task.model_dump(mode="json"), ensure_ascii=False) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(seen)
