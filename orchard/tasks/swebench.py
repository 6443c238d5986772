"""SWE-bench and SWE-rebench instances (JSONL, one per line, as their Hugging Face datasets
publish them) as tasks.

Fields read, as the datasets name them: ``instance_id``, ``repo``, ``base_commit``, ``patch``
(the gold fix), ``test_patch``, ``problem_statement``, ``hints_text``, ``version``,
``environment_setup_commit``, ``created_at``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (JSON-encoded
lists of test ids in SWE-bench, plain lists in SWE-rebench), and SWE-bench Verified's
``difficulty``. SWE-rebench adds ``install_config`` (the harness specs: ``test_cmd``,
``log_parser``, ``install``, ...), ``meta`` and, in its newer releases, ``image_name`` or
``docker_image`` (the prebuilt image). Other fields are kept in the task's metadata.

Images follow the SWE-bench harness (``TestSpec.instance_image_key``): for a remote namespace
the key is ``{namespace}/sweb.eval.{arch}.{instance_id lower-cased}:{tag}`` with every ``__``
replaced by ``_1776_``; SWE-bench publishes under ``docker.io/swebench``, SWE-rebench under
``docker.io/swerebench``. The repository is at ``/testbed``, committed by the image build, and
tests run in the ``testbed`` conda environment, on the files the test patch touches, as the
harness does (``get_test_directives``). Unlike our generated tasks, other tests in those files
may fail before and after the fix, so these tasks judge only the listed ids
(``clean_run_required=False``) and the commands accept the runner's "some tests failed" exit
status (1) while still failing on crashes, usage errors and kills.

Not supported (rejected, or skipped with ``skip_unsupported``): sympy (its ``bin/test`` names
tests differently) and SWE-rebench instances whose log parser is not pytest's.
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from pydantic import ValidationError

from orchard.tasks.task import Task, TaskFileError

SWEBENCH_NAMESPACE = "docker.io/swebench"
SWEREBENCH_NAMESPACE = "docker.io/swerebench"
ACTIVATE = ". /opt/miniconda3/bin/activate && conda activate testbed"
PYTEST = "pytest --no-header -rA --tb=no -p no:cacheprovider"
DJANGO = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
DJANGO_NO_PARALLEL = "./tests/runtests.py --verbosity 2"
NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
UNSUPPORTED_REPOS = {"sympy/sympy": "sympy's bin/test runner names tests in a format no parser here reads"}
REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "FAIL_TO_PASS")
_KNOWN = set(REQUIRED) | {"PASS_TO_PASS", "hints_text", "version", "environment_setup_commit", "created_at",
                          "difficulty", "install_config", "meta", "image_name", "docker_image"}
_DIFF_HEADER = re.compile(r"diff --git a/.* b/(.*)")
_DJANGO_ID = re.compile(r"^(\w+) \(([\w.]+)\)$")


class Unsupported(Exception):
    """An instance this loader cannot turn into a gradable task (the reason says why)."""


def instance_image(instance_id: str, namespace: str = SWEBENCH_NAMESPACE, arch: str = "x86_64",
                   tag: str = "latest") -> str:
    """The prebuilt instance image, named as the SWE-bench harness names remote images."""
    key = f"sweb.eval.{arch}.{instance_id.lower()}:{tag}"
    return "docker://" + f"{namespace}/{key}".replace("__", "_1776_")


def docker_reference(name: str) -> str:
    """An image name from a dataset as a ``docker://`` reference with an explicit registry."""
    name = name.removeprefix("docker://")
    first = name.split("/", 1)[0]
    if "/" not in name or not ("." in first or ":" in first or first == "localhost"):
        name = f"docker.io/{name}"
    return f"docker://{name}"


def test_directives(repo: str, test_patch: str) -> list[str]:
    """What the harness passes to the test runner: the test patch's files (Django: modules)."""
    paths = [p for p in _DIFF_HEADER.findall(test_patch) if not p.endswith(NON_TEST_EXTS)]
    if repo != "django/django":
        return paths
    modules = []
    for path in paths:
        name = posixpath.basename(path)
        if not (name == "tests.py" or name.startswith("test_") or "/tests/" in path or "/test_" in path):
            continue
        path = path[:-3] if path.endswith(".py") else path
        modules.append((path[len("tests/"):] if path.startswith("tests/") else path).replace("/", "."))
    return modules


test_directives.__test__ = False  # type: ignore[attr-defined]  # not a test: pytest must not collect it


def _tolerant(command: str) -> str:
    """Run in the testbed env; exit 0 when the runner finished (0: all passed, 1: some failed)."""
    return f"{ACTIVATE} && {{ {command}; test $? -le 1; }}"


def _id_list(instance: dict, key: str) -> list[str]:
    value = instance.get(key, [])
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise ValueError(f"{key}: not a JSON-encoded list ({exc.msg})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key}: expected a list of test ids")
    return value


def _django_id(test_id: str) -> str:
    """SWE-bench's "test_x (module.Class)" as the unittest parser's "module.Class.test_x"; a
    docstring description stays as it is (the parser records those too)."""
    match = _DJANGO_ID.match(test_id)
    return f"{match.group(2)}.{match.group(1)}" if match else test_id


def _runner(instance: dict, source: str) -> tuple[str, str]:
    """(test framework, command before the directives) of an instance."""
    repo, config = instance["repo"], instance.get("install_config") or {}
    if repo in UNSUPPORTED_REPOS:
        raise Unsupported(UNSUPPORTED_REPOS[repo])
    if repo == "django/django":
        return "unittest", DJANGO_NO_PARALLEL if str(instance.get("version")) == "1.9" else DJANGO
    if source == "swe-rebench" and isinstance(config, dict) and config.get("test_cmd"):
        parser = str(config.get("log_parser") or "parse_log_pytest")
        if not parser.startswith("parse_log_pytest"):
            raise Unsupported(f"log parser {parser} is not pytest's")
        command = config["test_cmd"]
        return "pytest", " && ".join(command) if isinstance(command, list) else str(command)
    return "pytest", PYTEST


def instance_to_task(instance: dict, *, source: str = "swe-bench", namespace: Optional[str] = None,
                     split: str = "test", arch: str = "x86_64") -> Task:
    """One dataset instance as a task (raises ValueError naming the field, or Unsupported)."""
    missing = [key for key in REQUIRED if key not in instance]
    if missing:
        raise ValueError(f"{missing[0]}: field required")
    for key in REQUIRED[:-1]:
        if not isinstance(instance[key], str):
            raise ValueError(f"{key}: expected a string, got {type(instance[key]).__name__}")
    framework, command = _runner(instance, source)
    fail_to_pass, pass_to_pass = _id_list(instance, "FAIL_TO_PASS"), _id_list(instance, "PASS_TO_PASS")
    if not fail_to_pass:
        raise ValueError("FAIL_TO_PASS: no test ids (nothing would show the fix)")
    if instance["repo"] == "django/django":
        fail_to_pass, pass_to_pass = [_django_id(t) for t in fail_to_pass], [_django_id(t) for t in pass_to_pass]
    directives = test_directives(instance["repo"], instance["test_patch"])
    default_namespace = SWEREBENCH_NAMESPACE if source == "swe-rebench" else SWEBENCH_NAMESPACE
    own_image = instance.get("image_name") or instance.get("docker_image")
    image = (docker_reference(own_image) if isinstance(own_image, str) and own_image and namespace is None
             else instance_image(instance["instance_id"], namespace or default_namespace, arch))
    extra = {key: value for key, value in instance.items() if key not in _KNOWN}
    metadata: dict[str, Any] = {"source": source, "repo": instance["repo"], "base_commit": instance["base_commit"],
                                "version": instance.get("version"), "hints_text": instance.get("hints_text", ""),
                                "environment_setup_commit": instance.get("environment_setup_commit"),
                                "created_at": instance.get("created_at"), **extra}
    for key in ("install_config", "meta"):
        if instance.get(key) is not None:
            metadata[key] = instance[key]
    return Task(
        task_id=instance["instance_id"], image=image, problem_statement=instance["problem_statement"],
        workdir="/testbed", setup=["git config --global --add safe.directory /testbed"],
        test_commands=[_tolerant(" ".join([command, *directives]))], test_framework=framework,
        clean_run_required=False, fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass,
        test_patch=instance["test_patch"], reference_patch=instance["patch"],
        difficulty=instance.get("difficulty") if isinstance(instance.get("difficulty"), str) else None,
        tags=[instance["repo"]], split=split, metadata=metadata,
    )


def _instances(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})",
                                    str(path), number) from None
            if not isinstance(data, dict):
                raise TaskFileError(f"{path}:{number}: expected a JSON object", str(path), number)
            yield number, data


def _load(path: Union[str, Path], source: str, namespace: Optional[str], split: str,
          skip_unsupported: bool) -> list[Task]:
    path = Path(path)
    tasks: list[Task] = []
    for number, instance in _instances(path):
        try:
            task = instance_to_task(instance, source=source, namespace=namespace, split=split)
        except Unsupported as exc:
            if skip_unsupported:
                continue
            raise TaskFileError(f"{path}:{number}: {instance.get('instance_id')}: unsupported: {exc} "
                                "(pass skip_unsupported=True to skip such instances)", str(path), number) from None
        except ValidationError as exc:  # the instance maps to an invalid task (e.g. a bad id)
            error = exc.errors()[0]
            field = ".".join(str(part) for part in error["loc"]) or "(task)"
            raise TaskFileError(f"{path}:{number}: {instance.get('instance_id')}: task field {field}: "
                                f"{error['msg']}", str(path), number, field) from None
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            raise TaskFileError(f"{path}:{number}: {exc}", str(path), number, field) from None
        tasks.append(task)
    return tasks


def load_swebench(path: Union[str, Path], *, namespace: Optional[str] = None, split: str = "test",
                  skip_unsupported: bool = False) -> list[Task]:
    """Tasks from a SWE-bench (or Lite/Verified) JSONL file; images under ``namespace``
    (default ``docker.io/swebench``)."""
    return _load(path, "swe-bench", namespace, split, skip_unsupported)


def load_swerebench(path: Union[str, Path], *, namespace: Optional[str] = None, split: str = "train",
                    skip_unsupported: bool = False) -> list[Task]:
    """Tasks from a SWE-rebench JSONL file; the instance's own image when it names one (and
    ``namespace`` is not given), else the harness scheme under ``docker.io/swerebench``."""
    return _load(path, "swe-rebench", namespace, split, skip_unsupported)
