"""Grading a model cannot tamper with.

The reward never reads anything the model could have written in its rollout sandbox but
its diff (a diff graded once for a task is not graded again: tests are taken as
deterministic, as every grader does). ``git diff`` of the repository there is taken as
untrusted bytes: anything but plain ``git diff`` output is refused
(:func:`orchard.tasks.patches.check_git_diff`); then, in a *fresh* fork of the task's
starting state, git itself is asked which paths the diff touches (applied to a scratch
index), and a diff touching a protected path (tests, test configuration, ``.git``) or
adding a top-level module that would shadow what the test runner imports is refused
whole. Otherwise it is applied there, the task's test patch after it, and the tests run.
Deleting or editing the tests, planting a fake ``pytest`` or a "passed" marker, killing
processes, rewriting ``git`` or its configuration in the rollout sandbox changes nothing
there. Code under test still runs in the grading sandbox and can try to fool the runner
from inside; where the test command discovers tests, a *canary* (a randomly named test
that must fail, written only in the grading fork) catches a runner that passes
everything (:func:`plan_canary`).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.machinery
import posixpath
import random
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Optional, Union

from orchard.client.aio import AsyncSandbox
from orchard.errors import FileOperationFailed
from orchard.rollout.environment import PreparedTask, delete_sandbox
from orchard.rollout.loop import exec_timeout
from orchard.rollout.sample import Grade
from orchard.tasks import Task
from orchard.tasks.parsers import tests_passed
from orchard.tasks.patches import unquote_path, check_git_diff

MAX_DIFF_BYTES = 8 << 20
# Top-level names a new file may not take: it would shadow what the test runner imports
# (``python3 -m unittest`` puts the repository first on sys.path, so a new ``unittest.py``,
# ``unittest.pyc`` or ``re/`` there would replace the judge).
SHADOWED = frozenset(sys.stdlib_module_names) | {"pytest", "_pytest", "pluggy", "py", "sitecustomize",
                                                 "usercustomize", "nose", "nose2"}
MODULE_SUFFIXES = tuple(sorted(set(importlib.machinery.all_suffixes()) | {".py", ".pyc", ".so"}))
# New top-level packaging metadata: an ``*.dist-info`` with a ``pytest11`` entry point loads a
# plugin into pytest, a ``*.pth`` runs code at start-up wherever it lands on the path.
PACKAGING_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".pth")
# git as a grader runs it: no pager, hooks, external diff, text conversion, fsmonitor or
# colour; paths with a/ b/ prefixes and C-quoted when unusual, whatever the repository says.
SAFE_GIT = ("git -c core.pager=cat -c core.hooksPath=/dev/null -c core.fsmonitor=false -c diff.external= "
            "-c color.ui=false -c diff.noprefix=false -c diff.mnemonicPrefix=false -c core.quotePath=true")
AGENT_PATCH = "/tmp/.orchard-agent.diff"
TEST_PATCH = "/tmp/.orchard-test.diff"


class RefusedDiff(str):
    """What :func:`extract_diff` returns when no diff can be taken from the rollout sandbox (a
    diff file that is too large or not a regular file, git failing there): an empty diff that
    :func:`grade` refuses with ``reason`` (reward -1, the rollout is not aborted)."""

    reason: str

    def __new__(cls, reason: str) -> "RefusedDiff":
        refused = super().__new__(cls, "")
        refused.reason = reason
        return refused


async def extract_diff(sandbox: AsyncSandbox, task: Task) -> str:
    """The model's change: every file it added, changed or removed in the repository, as a
    binary-safe ``git diff`` against the starting commit ("" when there is none). Its bytes
    come back as ``str`` losslessly (undecodable bytes as surrogate escapes: ``grade``
    encodes them back). Everything in the sandbox is the model's, git included, so this is
    only a request: the grader checks what it gets."""
    directory = f"/tmp/.orchard-diff-{secrets.token_hex(8)}"
    diff_file = f"{directory}/diff"
    command = (f"mkdir -m 700 {directory} && {{ {SAFE_GIT} add -A >/dev/null 2>&1; "
               f"{SAFE_GIT} diff --cached --binary --no-ext-diff --no-textconv --no-color --no-relative "
               f"--no-renames --src-prefix=a/ --dst-prefix=b/ HEAD > {diff_file}; }}")
    job = await sandbox.exec(command, cwd=task.workdir, timeout=exec_timeout(task.command_timeout_seconds, task.task_id))
    if not job.ok:
        return RefusedDiff(f"git diff failed in the rollout sandbox (exit {job.exit_code}, "
                           f"{job.error_type or 'no error'}): {(job.stderr or job.error or '')[-300:]}")
    try:
        entries = {entry.name: entry for entry in await sandbox.list_files(directory)}
        entry = entries.get("diff")
        if entry is None or entry.type != "file":
            return RefusedDiff(f"the diff file is not a regular file ({entry.type if entry else 'missing'})")
        if entry.size > MAX_DIFF_BYTES:
            return RefusedDiff(f"the diff is {entry.size} bytes, more than {MAX_DIFF_BYTES}")
        data = await _download_capped(sandbox, diff_file, MAX_DIFF_BYTES)
    except FileOperationFailed as exc:
        return RefusedDiff(f"the diff file could not be read: {exc.message}")
    if data is None:
        return RefusedDiff(f"the diff grew past {MAX_DIFF_BYTES} bytes while it was read")
    return data.decode("utf-8", errors="surrogateescape")


async def _download_capped(sandbox: AsyncSandbox, path: str, cap: int) -> Optional[bytes]:
    """A file's bytes, or None as soon as it proves larger than ``cap`` (read as a stream:
    what the sandbox swaps in after a size check cannot make the trainer read more)."""
    download = getattr(sandbox.api, "download", None)
    if download is None:  # a lost sandbox's stand-in: its download raises why
        data = await sandbox.download(path)
        return data if len(data) <= cap else None
    size, chunks = await download(f"/sandboxes/{sandbox.id}/files/raw", params={"path": path}, timeout=600)
    parts: list[bytes] = []
    total = 0
    try:
        async for chunk in chunks:
            total += len(chunk)
            if total > cap or (size or 0) > cap:
                return None
            parts.append(chunk)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    return b"".join(parts)


def shadows(path: str) -> bool:
    """Whether a *new* top-level entry at ``path`` could replace what the test runner imports:
    a module (any suffix the import system loads: ``unittest.py``, ``unittest.pyc``,
    ``unittest.abi3.so``) or package (``re/``) named like one in ``SHADOWED``, or packaging
    metadata (``*.dist-info``, ``*.egg-info``, ``*.egg-link``, ``*.pth``) whatever its name."""
    top, _, rest = path.partition("/")
    if top.endswith(PACKAGING_SUFFIXES):
        return True
    if rest or "." not in top:  # a package directory, or a link to one
        return top in SHADOWED
    return top.endswith(MODULE_SUFFIXES) and top.split(".")[0] in SHADOWED


# -- the canary: a test that must fail --------------------------------------------------
_PYTHON = re.compile(r"(?:/[\w./-]*/)?python(?:\d+(?:\.\d+)?)?")
_PYTHON_FLAGS = {"-B", "-u"}  # no bytecode written, unbuffered: neither changes what is discovered
_UNITTEST_FLAGS = {"-v", "--verbose", "-q", "--quiet", "-b", "--buffer", "-c", "--catch", "--locals"}
_UNITTEST_VALUED = {"-s": "start", "--start-directory": "start", "-p": "pattern", "--pattern": "pattern",
                    "-t": "top", "--top-level-directory": "top"}
_PYTEST_FLAGS = {"-v", "-vv", "-vvv", "-q", "-qq", "-s", "-l", "--showlocals", "--no-header", "--disable-warnings",
                 "--strict-markers", "--verbose", "--quiet"}
_PYTEST_VALUED = {"-p", "--tb", "--color", "--capture", "-W", "--import-mode"}
_PYTEST_REPORT = re.compile(r"-r[fEsxXpPaAN]+")


@dataclass(frozen=True)
class Canary:
    """Tests planted in the grading fork that must be reported FAILED: a runner (or code under
    test) that makes every test pass makes these pass too, and the run is not trusted."""

    path: str  # relative to the task's workdir
    source: str
    names: tuple[str, ...]  # the planted test functions' names (random)
    commands: list[str]  # the task's test commands, with the canary's path where one must name it


def _words(command: str) -> Optional[list[str]]:
    """The words of a simple command (quoting allowed; no expansions, redirections, pipes or
    lists), or None."""
    if any(char in command for char in "$`\\\n"):
        return None
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:
        return None
    return words if words and not any(set(word) <= set("();<>|&") for word in words) else None


def _module_args(words: list[str], module: str) -> Optional[list[str]]:
    """The arguments after ``python [-B] [-u] -m MODULE``, or None for another command."""
    if not words or not _PYTHON.fullmatch(words[0]):
        return None
    index = 1
    while index < len(words) and words[index] in _PYTHON_FLAGS:
        index += 1
    return words[index + 2:] if words[index:index + 2] == ["-m", module] else None


def _relative(path: str) -> Optional[str]:
    norm = posixpath.normpath(path)
    return None if norm.startswith(("/", "..")) else norm


def _unittest_start(words: list[str], filename: str) -> Optional[str]:
    """The start directory of ``python -m unittest discover ...`` when ``filename`` there
    would be discovered (None: not such a command, or options we do not read)."""
    after = _module_args(words, "unittest")
    if not after or after[0] != "discover":
        return None
    found: dict[str, str] = {}
    positional: list[str] = []
    args = iter(after[1:])
    for word in args:
        name, equals, value = word.partition("=")
        if word in _UNITTEST_FLAGS:
            continue
        if word in _UNITTEST_VALUED or (equals and name.startswith("--") and name in _UNITTEST_VALUED):
            value = value if equals else next(args, "")
            if not value or _UNITTEST_VALUED[name] in found:
                return None
            found[_UNITTEST_VALUED[name]] = value
        elif word.startswith("-"):
            return None  # -f (failfast), -k (filters): the canary would stop or be left out
        else:
            positional.append(word)
    if len(positional) > 3:
        return None
    for slot, value in zip(("start", "pattern", "top"), positional):
        if slot in found:
            return None
        found[slot] = value
    if not fnmatchcase(filename, found.get("pattern", "test*.py")):
        return None
    return _relative(found.get("start", "."))


def _pytest_directory(words: list[str]) -> Optional[str]:
    """Where a canary goes for ``pytest ARGS PATHS...`` (the directory of the first path), or
    None: not such a command, no paths, or options we do not read (``-x``, ``-k``...)."""
    if words and posixpath.basename(words[0]) in ("pytest", "py.test"):
        args = iter(words[1:])
    elif (after := _module_args(words, "pytest")) is not None:
        args = iter(after)
    else:
        return None
    paths: list[str] = []
    for word in args:
        name, equals, _ = word.partition("=")
        if word in _PYTEST_FLAGS or _PYTEST_REPORT.fullmatch(word) or (equals and name in _PYTEST_VALUED):
            continue
        if word in _PYTEST_VALUED:
            if not next(args, ""):
                return None
        elif word.startswith("-") or "::" in word or "[" in word:
            return None
        else:
            paths.append(word)
    if not paths or any(_relative(p) is None for p in paths):
        return None
    first = _relative(paths[0]) or "."
    return (posixpath.dirname(first) or ".") if first.endswith(".py") else first


def plan_canary(task: Task) -> Optional[Canary]:
    """A canary for ``task``, or None where one cannot be placed for sure. It applies to
    tasks with exactly one test command, written without shell syntax, that is either
    ``python -m unittest discover`` (framework unittest; python may take -B and -u; options
    -v -q -b -c --locals -s -p -t, the pattern matching ``test_*.py``; the canary goes into the start directory and is
    discovered there) or ``pytest``/``python -m pytest`` with at least one path argument and
    only the options -v -q -s -l -r.. --tb --color --capture -W --import-mode -p
    --no-header (framework pytest; the canary goes next to the first path and its path is
    appended to the command). Commands that select, stop early or use shell syntax beyond
    quoting (SWE-bench's ``... && { pytest ...; test $? -le 1; }``), and other runners
    (Django's ``runtests.py``), get none."""
    if len(task.test_commands) != 1 or task.test_framework not in ("unittest", "pytest"):
        return None
    command = task.test_commands[0]
    words = _words(command)
    if words is None:
        return None
    token = secrets.token_hex(8)
    filename = f"test_{token}.py"
    if task.test_framework == "unittest":
        directory = _unittest_start(words, filename)
        commands = [command]
    else:
        directory = _pytest_directory(words)
        commands = [f"{command} {shlex.quote(posixpath.join(directory, filename))}"] if directory is not None else []
    if directory is None:
        return None
    pick = random.SystemRandom()
    a, b = pick.sample(range(1000, 10 ** 6), 2)
    names = (f"test_{token}_equal", f"test_{token}_assert")
    source = (f"import unittest\n\n\nclass Test{token}(unittest.TestCase):\n"
              f"    def {names[0]}(self):\n        self.assertEqual({a}, {b})\n\n"
              f"    def {names[1]}(self):\n        assert {b} == {a}\n")
    return Canary(posixpath.join(directory, filename), source, names, commands)


# -- grading -----------------------------------------------------------------------------
def _refused(reason: str, start: float, paths: Optional[list[str]] = None) -> Grade:
    return Grade(False, f"the diff was refused: {reason}", dropped_paths=paths or [],
                 seconds=time.perf_counter() - start)


async def grade(prepared: PreparedTask, diff: Union[str, bytes]) -> Grade:
    """Refuse ``diff`` if it is not plain ``git diff`` output or git reads it as touching a
    protected or shadowing path; otherwise apply it to a fresh sandbox in the task's
    starting state, then the test patch, then run the tests: resolved or not, and why.
    ``dropped_paths`` names the paths a refused diff touched (nothing of it was applied)."""
    task = prepared.task
    start = time.perf_counter()
    if isinstance(diff, RefusedDiff):
        return _refused(diff.reason, start)
    try:
        data = diff if isinstance(diff, bytes) else diff.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError as exc:
        return _refused(f"it holds text no bytes stand for ({exc.reason})", start)
    if len(data) > MAX_DIFF_BYTES:
        return _refused(f"it is {len(data)} bytes, more than {MAX_DIFF_BYTES}", start)
    problem = check_git_diff(data)
    if problem:
        return _refused(f"it is not plain `git diff` output ({problem})", start)
    # The same change to the same task (its content: tests, test patch, commands) gets the same verdict.
    digest = hashlib.sha256(hashlib.sha256(task.model_dump_json().encode()).digest() + data).hexdigest()
    known = prepared.grades.get(digest)
    if known is None:
        known = prepared.grades[digest] = asyncio.ensure_future(_graded(prepared, data, start))
        first = True
    else:
        first = False
    try:
        result = await asyncio.shield(known)
    except BaseException:
        if known.done() and prepared.grades.get(digest) is known:
            del prepared.grades[digest]  # an environment failure is not a verdict: grade again next time
        raise
    return result if first else replace(result, seconds=0.0, cached=True)


async def _touched(sandbox: AsyncSandbox, task: Task) -> Union[str, list[tuple[str, str]]]:
    """git's own reading of the uploaded agent diff: ``(status, path)`` for every path it
    adds (A), deletes (D), modifies or re-types (M, T), found by applying it to a scratch
    index of HEAD; or why that failed."""
    script = (f'index=$(mktemp -u /tmp/.orchard-index.XXXXXXXX) && export GIT_INDEX_FILE="$index" && '
              f"{SAFE_GIT} read-tree HEAD && {SAFE_GIT} apply --cached -p1 --whitespace=nowarn {AGENT_PATCH} && "
              f"{SAFE_GIT} diff --cached --no-renames --no-relative --no-ext-diff --name-status HEAD")
    job = await sandbox.exec(script, cwd=task.workdir, timeout=exec_timeout(task.command_timeout_seconds, task.task_id))
    if not job.ok:
        return f"the agent diff does not apply: {(job.stderr or job.error or '')[-500:]}"
    if job.truncated:
        return "the agent diff touches more paths than git's listing of them can hold"
    touched = []
    for line in job.stdout.split("\n"):
        if line:
            status, _, path = line.partition("\t")
            touched.append((status[:1], unquote_path(path)))
    return touched


async def _top_level_directories(sandbox: AsyncSandbox, task: Task) -> Optional[set[str]]:
    """The top-level directories of HEAD (None: git could not say)."""
    job = await sandbox.exec(f"{SAFE_GIT} ls-tree HEAD", cwd=task.workdir, timeout=exec_timeout(task.command_timeout_seconds, task.task_id))
    if not job.ok or job.truncated:
        return None
    entries = (line.split("\t", 1) for line in job.stdout.split("\n") if "\t" in line)
    return {unquote_path(name) for meta, name in entries if meta.split(" ")[1:2] == ["tree"]}


async def _graded(prepared: PreparedTask, data: bytes, start: float) -> Grade:
    task = prepared.task
    sandbox = await prepared.sandbox()
    try:
        if data.strip():
            await sandbox.upload(AGENT_PATCH, data)
            touched = await _touched(sandbox, task)
            if isinstance(touched, str):
                return Grade(False, touched, seconds=time.perf_counter() - start)
            protected = [path for _, path in touched if task.is_protected(path)]
            if protected:
                return _refused(f"it touches protected path(s) {', '.join(protected[:10])}", start, protected)
            # New, unless inside a directory HEAD already has there (a file of that name was new).
            candidates = [path for status, path in touched if status == "A" and shadows(path)]
            directories = await _top_level_directories(sandbox, task) if candidates else set()
            shadowing = [p for p in candidates
                         if "/" not in p or directories is None or p.split("/", 1)[0] not in directories]
            if shadowing:
                return _refused(f"it adds top-level path(s) that would shadow what the test runner imports: "
                                f"{', '.join(shadowing[:10])}", start, shadowing)
            applied = await sandbox.exec(f"{SAFE_GIT} apply -p1 --whitespace=nowarn {AGENT_PATCH}", cwd=task.workdir,
                                         timeout=exec_timeout(task.command_timeout_seconds, task.task_id))
            if not applied.ok:
                return Grade(False, f"the agent diff does not apply: {applied.stderr[-500:]}",
                             seconds=time.perf_counter() - start)
        if task.test_patch.strip():
            await sandbox.upload(TEST_PATCH, task.test_patch)
            applied = await sandbox.exec(f"{SAFE_GIT} apply -p1 --whitespace=nowarn {TEST_PATCH}", cwd=task.workdir,
                                         timeout=exec_timeout(task.command_timeout_seconds, task.task_id))
            if not applied.ok:
                return Grade(False, f"the test diff does not apply: {applied.stderr[-500:]}",
                             seconds=time.perf_counter() - start)
        canary = plan_canary(task)
        commands = task.test_commands
        if canary is not None:
            try:
                await sandbox.upload(posixpath.join(task.workdir, canary.path), canary.source)
            except FileOperationFailed as exc:
                return Grade(False, f"the canary test could not be written: {exc.message}",
                             seconds=time.perf_counter() - start)
            commands = canary.commands
        outputs, codes = [], []
        for command in commands:
            job = await sandbox.exec(command, cwd=task.workdir, timeout=exec_timeout(task.command_timeout_seconds, task.task_id))
            outputs.append(job.stdout + job.stderr)
            codes.append(job.exit_code if job.exit_code is not None else -1)
        resolved, details = tests_passed(task, outputs, codes, canaries=canary.names if canary else ())
        return Grade(resolved, details["reason"], tests=details["results"], seconds=time.perf_counter() - start)
    finally:
        await delete_sandbox(sandbox)  # to the end, even when a straggler is cut off meanwhile
