"""Grading a model cannot tamper with.

The reward never reads anything the model could have written in its rollout sandbox but
its diff (a diff graded once for a task is not graded again: tests are taken as
deterministic, as every grader does): ``git diff`` of the repository there is taken as untrusted text, stripped of every
file the task protects (tests, test configuration, ``.git``), and applied to a *fresh* fork
of the task's starting state, where the task's test patch is applied and its tests run.
Deleting or editing the tests, planting a fake ``pytest`` or a "passed" marker, killing
processes or rewriting ``git`` in the rollout sandbox changes nothing there. What remains
possible is what any test-based grader allows: code under test runs in the grading
sandbox, so a change written to fool the test runner itself is only caught by the
runner's own summary check (see ``orchard.tasks.parsers``).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import sys
import time
from dataclasses import replace
from pathlib import PurePosixPath

from orchard.client.aio import AsyncSandbox
from orchard.errors import CommandFailed, FileOperationFailed
from orchard.rollout.environment import PreparedTask
from orchard.rollout.sample import Grade
from orchard.tasks import Task
from orchard.tasks.parsers import tests_passed
from orchard.tasks.patches import drop_protected, split_patch

MAX_DIFF_BYTES = 8 << 20
# Top-level names a new file may not take: it would shadow what the test runner imports
# (``python3 -m unittest`` puts the repository first on sys.path, so a new ``unittest.py`` or
# ``re.py`` there would replace the judge).
SHADOWED = frozenset(sys.stdlib_module_names) | {"pytest", "_pytest", "pluggy", "py", "sitecustomize",
                                                 "usercustomize", "nose", "nose2"}
# git as a grader runs it: no pager, no external diff or text conversion, no hooks, no colour.
SAFE_GIT = "git -c core.pager=cat -c core.hooksPath=/dev/null -c diff.external= -c color.ui=false"


async def extract_diff(sandbox: AsyncSandbox, task: Task) -> str:
    """The model's change: every file it added, changed or removed in the repository, as a
    binary-safe ``git diff`` against the starting commit ("" when there is none)."""
    diff_file = f"/tmp/.orchard-diff-{secrets.token_hex(4)}"
    command = (f"{SAFE_GIT} add -A >/dev/null 2>&1; "
               f"{SAFE_GIT} diff --cached --binary --no-ext-diff --no-textconv HEAD > {diff_file}")
    job = await sandbox.exec(command, cwd=task.workdir, timeout=task.command_timeout_seconds)
    if not job.ok:
        return ""
    try:
        data = await sandbox.download(diff_file)
    except FileOperationFailed:
        return ""
    if len(data) > MAX_DIFF_BYTES:
        raise CommandFailed(f"the diff is {len(data)} bytes, more than {MAX_DIFF_BYTES}")
    return data.decode("utf-8", errors="replace")


def _shadows(path: str) -> bool:
    top = path.split("/", 1)[0]
    name = top[:-3] if top.endswith(".py") and "/" not in path else top
    return name in SHADOWED or top.endswith(".pth")


def drop_shadowing(patch: str) -> tuple[str, list[str]]:
    """The patch without sections that *add* a top-level module of a name in ``SHADOWED``
    (changing such a file the repository already has is left alone)."""
    kept: list[str] = []
    dropped: list[str] = []
    for paths, text in split_patch(patch):
        added = "\nnew file mode" in text or "\nrename to " in text or "\ncopy to " in text
        hit = [p for p in paths if _shadows(p)] if added else []
        if hit:
            dropped.extend(p for p in hit if p not in dropped)
        else:
            kept.append(text if text.endswith("\n") else text + "\n")
    return "".join(kept), dropped


async def grade(prepared: PreparedTask, diff: str) -> Grade:
    """Apply ``diff`` (protected files dropped) to a fresh sandbox in the task's starting
    state, then the test patch, then run the tests: resolved or not, and why."""
    task = prepared.task
    start = time.perf_counter()
    kept, dropped = drop_protected(diff, task.protected_paths)
    kept, shadowing = drop_shadowing(kept)
    dropped += shadowing
    digest = hashlib.sha256(kept.encode()).hexdigest()
    known = prepared.grades.get(digest)  # the same change from the same starting state: the same verdict
    if known is None:
        known = prepared.grades[digest] = asyncio.ensure_future(_graded(prepared, kept, start))
        first = True
    else:
        first = False
    try:
        result = await asyncio.shield(known)
    except BaseException:
        if known.done() and prepared.grades.get(digest) is known:
            del prepared.grades[digest]  # an environment failure is not a verdict: grade again next time
        raise
    return replace(result, dropped_paths=dropped, **({} if first else {"seconds": 0.0, "cached": True}))


async def _graded(prepared: PreparedTask, kept: str, start: float) -> Grade:
    task = prepared.task
    sandbox = await prepared.sandbox()
    try:
        for name, patch in (("agent", kept), ("test", task.test_patch)):
            if not patch.strip():
                continue
            path = str(PurePosixPath("/tmp") / f".orchard-{name}.diff")
            await sandbox.upload(path, patch)
            applied = await sandbox.exec(f"{SAFE_GIT} apply --whitespace=nowarn {path}", cwd=task.workdir,
                                         timeout=task.command_timeout_seconds)
            if not applied.ok:
                return Grade(False, f"the {name} diff does not apply: {applied.stderr[-500:]}",
                             seconds=time.perf_counter() - start)
        outputs, codes = [], []
        for command in task.test_commands:
            job = await sandbox.exec(command, cwd=task.workdir, timeout=task.command_timeout_seconds)
            outputs.append(job.stdout + job.stderr)
            codes.append(job.exit_code if job.exit_code is not None else -1)
        resolved, details = tests_passed(task, outputs, codes)
        return Grade(resolved, details["reason"], tests=details["results"], seconds=time.perf_counter() - start)
    finally:
        await sandbox.delete()
