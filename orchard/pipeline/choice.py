"""Generated tasks with a small action space: pick the right fix among candidates.

A model that can be trained on a 2-core CPU in minutes cannot write patches. So the
pipeline's tasks keep the generated repository, its planted bug, its tests and its grader,
and add numbered candidate edits ``.candidates/<N>.diff`` (ignored by git): one per function
of the package, plus decoys named after functions of other tasks, up to ``size``, in a
shuffled order. The buggy function's candidate is the task's reference fix; the others are
harmless edits (a comment) that apply cleanly and fix nothing. The issue gains the call path
of the failure, as a traceback would show it (the function the issue names, then the helper
it calls where the bug sits), each frame with its candidate's number, and how many candidates
there are (numbers only: a list of names let a model map a training variant's names to the
buggy one's number without reading the call path, a shortcut no held-out variant allows).
An agent resolves the task by applying the right candidate
(``git apply .candidates/N.diff``) and submitting: the skill is reading the innermost frame
of the call path (held-out tasks come from held-out variants, with names never seen).
Grading is unchanged: the tests run in a fresh fork of the starting state. This is a small
action space on purpose (a model trained on two CPU cores in minutes cannot write patches);
a real model on real tasks writes its own edits with the same loop, grader and trainers.
"""

from __future__ import annotations

import ast
import difflib
import random
import re
from pathlib import PurePosixPath
from typing import Sequence

from orchard.tasks import Task

CANDIDATES = ".candidates"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? ", re.MULTILINE)


def functions(source: str) -> dict[str, tuple[int, int]]:
    """Top-level functions of a module: name -> (first line, last line), 1-based."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = (node.lineno, node.end_lineno or node.lineno)
    return found


def _comment_edit(path: str, source: str, line: int) -> str:
    """A diff adding a harmless comment above line ``line`` of ``path``."""
    lines = source.splitlines(keepends=True)
    edited = lines[:line - 1] + ["# reviewed\n"] + lines[line - 1:]
    body = "".join(difflib.unified_diff(lines, edited, f"a/{path}", f"b/{path}"))
    return f"diff --git a/{path} b/{path}\n{body}"


def buggy_function(task: Task) -> str:
    """The function the reference patch changes (its first hunk's lines)."""
    path = task.metadata["bug_file"]
    match = _HUNK.search(task.reference_patch)
    if match is None:
        raise ValueError(f"{task.task_id}: the reference patch has no hunk")
    start = int(match.group(1))
    span = range(start, start + int(match.group(2) or 1))
    for name, (first, last) in functions(task.files[path]).items():
        if any(first <= line <= last for line in span):
            return name
    raise ValueError(f"{task.task_id}: no function of {path} holds the reference patch's hunk")


def _call_path(task: Task, fix_in: str, number: dict[str, int]) -> str:
    module, _, named = task.metadata["symptom"].rpartition(".")
    frames = [(module.replace(".", "/") + ".py", named)]
    if named != fix_in:
        frames.append((task.metadata["bug_file"], fix_in))
    return "Traceback (most recent call last):\n" + "".join(
        f'  File "{path}", in {name} (candidate {number[name]})\n' if name in number else f'  File "{path}", in {name}\n'
        for path, name in frames)


def to_choice_task(task: Task, decoys: Sequence[str] = (), size: int = 6, seed: int = 0) -> Task:
    """``task`` with candidate fixes written into the repository and listed in the issue;
    ``decoys``: names to pad the list with (functions of other tasks), up to ``size``."""
    fix_in = buggy_function(task)
    candidates: dict[str, str] = {}
    for path, source in task.files.items():
        parts = PurePosixPath(path).parts
        if not path.endswith(".py") or parts[0] in ("tests", "test") or PurePosixPath(path).name == "__init__.py":
            continue
        for name, (first, _) in functions(source).items():
            if name in candidates:
                continue
            candidates[name] = task.reference_patch if name == fix_in and path == task.metadata["bug_file"] \
                else _comment_edit(path, source, first)
    if fix_in not in candidates:
        raise ValueError(f"{task.task_id}: the buggy function {fix_in} has no candidate")
    path = task.metadata["bug_file"]
    for name in decoys:
        if len(candidates) >= size:
            break
        if name not in candidates:
            candidates[name] = _comment_edit(path, task.files[path], 1)
    order = sorted(candidates)
    random.Random(f"{task.task_id}/{seed}").shuffle(order)
    number = {name: n for n, name in enumerate(order, 1)}
    files = dict(task.files)
    files[".gitignore"] = files.get(".gitignore", "") + f"{CANDIDATES}/\n"
    for name, diff in candidates.items():
        files[f"{CANDIDATES}/{number[name]}.diff"] = diff
    title = task.problem_statement.strip().splitlines()[0]  # the examples below it are left out: short prompts
    # The list gives numbers, not names: a variant's function names come from its own pools, so on training
    # variants "this name in the title -> that name's number in the list" resolves a task without reading
    # the call path, and fails on every held-out variant (names never seen). The call path comes last,
    # nearest the answer: a model this small learns to read a frame a few tokens back within minutes.
    statement = (f"{title}\n\nCandidate fixes 1 to {len(number)}, one per function (apply one with "
                 f"`git apply {CANDIDATES}/N.diff`).\n\n{_call_path(task, fix_in, number)}")
    metadata = {**task.metadata, "choice": {"fix": str(number[fix_in]), "candidates": [str(n) for n in number.values()],
                                            "names": {str(n): name for name, n in number.items()}}}
    return task.model_copy(update={"task_id": f"{task.task_id}-choice", "files": files,
                                   "problem_statement": statement, "metadata": metadata})


def choice_suite(tasks: Sequence[Task], size: int = 6, seed: int = 0) -> list[Task]:
    """Every task as a choice task, padded with decoys named after other tasks' functions."""
    names = sorted({name for task in tasks for path, source in task.files.items()
                    if path.endswith(".py") and not path.startswith("tests/") for name in functions(source)})
    rng = random.Random(seed)
    return [to_choice_task(task, rng.sample(names, min(len(names), 3 * size)), size, seed) for task in tasks]
