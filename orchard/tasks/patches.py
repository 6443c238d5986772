"""Unified diffs in git's format: which files a patch touches, and dropping protected files.

Grading applies the agent's diff, then the task's test patch. An agent that edits the tests
(or the test configuration) could make any change look like a fix, so the grader first drops
every file section of the agent's diff whose path a task protects (see
``Task.protected_paths``). This module splits a ``git diff`` into per-file sections and reads
their paths without calling git, so the same code runs in the trainer and in tests.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Iterable

_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "v": "\v", "r": "\r"}


def _unquote(text: str) -> str:
    """A path as git prints it: C-quoted when it holds unusual bytes (octal escapes are UTF-8)."""
    if not (len(text) >= 2 and text.startswith('"') and text.endswith('"')):
        return text
    body, raw, i = text[1:-1], bytearray(), 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            octal = body[i + 1:i + 4]
            if re.fullmatch(r"[0-7]{3}", octal):
                raw.append(int(octal, 8))
                i += 4
            else:
                raw.extend(_ESCAPES.get(body[i + 1], body[i + 1]).encode())
                i += 2
        else:
            raw.extend(body[i].encode())
            i += 1
    return raw.decode("utf-8", errors="surrogateescape")


def _strip_prefix(path: str) -> str:
    for prefix in ("a/", "b/"):
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def _header_paths(line: str) -> list[str]:
    """The two paths of a ``diff --git a/X b/Y`` line (unquoted and without a/ b/)."""
    rest = line[len("diff --git "):].rstrip("\n")
    quoted = _QUOTED.findall(rest)
    if rest.startswith('"') or rest.endswith('"'):
        if len(quoted) == 2:
            return [_strip_prefix(_unquote(f'"{q}"')) for q in quoted]
        first, _, second = rest.partition(" ")
        return [_strip_prefix(_unquote(first)), _strip_prefix(_unquote(second))]
    # Unquoted paths may hold spaces: a same-path header is "a/P b/P", so split in the middle.
    size = (len(rest) - 5) // 2
    if len(rest) == 2 * size + 5 and rest.startswith("a/") and rest[2 + size:5 + size] == " b/" \
            and rest[2:2 + size] == rest[5 + size:]:
        return [rest[2:2 + size]]
    match = re.fullmatch(r"a/(.*) b/(.*)", rest)
    return [match.group(1), match.group(2)] if match else [rest]


def split_patch(patch: str) -> list[tuple[list[str], str]]:
    """Split a git diff into ``(paths, section_text)`` per file, in order.

    ``paths`` holds every path the section touches: both sides of a rename or copy, and the
    ``---``/``+++`` names where they are more precise than the header. Text before the first
    ``diff --git`` line (a commit message, say) is dropped.
    """
    sections: list[tuple[list[str], str]] = []
    current: list[str] = []
    for line in patch.splitlines(keepends=True):
        if line.startswith("diff --git "):
            if current:
                sections.append(_section(current))
            current = [line]
        elif current:
            current.append(line)
    if current:
        sections.append(_section(current))
    return sections


def _section(lines: list[str]) -> tuple[list[str], str]:
    paths = _header_paths(lines[0])
    in_hunk = False
    for line in lines[1:]:
        if line.startswith("@@"):
            in_hunk = True
        if in_hunk:
            continue
        text = line.rstrip("\n")
        for prefix in ("--- ", "+++ ", "rename from ", "rename to ", "copy from ", "copy to "):
            if text.startswith(prefix):
                name = _unquote(text[len(prefix):].split("\t", 1)[0])
                if name != "/dev/null":
                    name = _strip_prefix(name) if prefix in ("--- ", "+++ ") else name
                    if name not in paths:
                        paths.append(name)
    return paths, "".join(lines)


def patch_files(patch: str) -> list[str]:
    """Every repository-relative path a git diff touches, first appearance first."""
    seen: list[str] = []
    for paths, _ in split_patch(patch):
        seen.extend(p for p in paths if p not in seen)
    return seen


def is_protected(path: str, patterns: Iterable[str]) -> bool:
    """Whether ``path`` matches one of the glob patterns (``fnmatch``, ``*`` crosses ``/``)."""
    path = path[2:] if path.startswith("./") else path
    return any(fnmatchcase(path, pattern) for pattern in patterns)


def drop_protected(patch: str, patterns: Iterable[str]) -> tuple[str, list[str]]:
    """The patch without the file sections that touch a protected path, and those paths.

    A section is dropped whole when any of its paths is protected (a rename out of
    ``tests/`` counts), so what is left still applies with ``git apply``.
    """
    patterns = list(patterns)
    kept: list[str] = []
    dropped: list[str] = []
    for paths, text in split_patch(patch):
        hit = [p for p in paths if is_protected(p, patterns)]
        if hit:
            dropped.extend(p for p in hit if p not in dropped)
        else:
            kept.append(text if text.endswith("\n") else text + "\n")
    return "".join(kept), dropped
