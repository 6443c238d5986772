"""Unified diffs in git's format: checking their form, and which files a patch touches.

Grading applies the agent's diff, then the task's test patch. An agent that edits the tests
(or the test configuration) could make any change look like a fix, so the grader refuses a
diff that touches a path the task protects (``Task.protected_paths``). Which paths a diff
touches is *git's* reading of it, asked in the grading sandbox (``orchard.rollout.grading``):
a parser of our own reads some diffs differently from ``git apply``. What this module adds
is :func:`check_git_diff`, which refuses anything that is not plainly ``git diff`` output
(text around or between sections, lines a hunk does not account for, control characters
in headers), so that git and we at least agree on where sections and hunks are.

``split_patch``, ``patch_files`` and ``drop_protected`` read a diff's text without git: they
name the files of a *trusted* patch (a task's test patch), never decide grading.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Iterable, Optional

_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "v": "\v", "r": "\r"}


def unquote_path(text: str) -> str:
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
            return [_strip_prefix(unquote_path(f'"{q}"')) for q in quoted]
        first, _, second = rest.partition(" ")
        return [_strip_prefix(unquote_path(first)), _strip_prefix(unquote_path(second))]
    # Unquoted paths may hold spaces: a same-path header is "a/P b/P", so split in the middle.
    size = (len(rest) - 5) // 2
    if len(rest) == 2 * size + 5 and rest.startswith("a/") and rest[2 + size:5 + size] == " b/" \
            and rest[2:2 + size] == rest[5 + size:]:
        return [rest[2:2 + size]]
    match = re.fullmatch(r"a/(.*) b/(.*)", rest)
    return [match.group(1), match.group(2)] if match else [rest]


def _lines(text: str) -> list[str]:
    """Lines as git splits them: on ``\\n`` only (``str.splitlines`` also splits on ``\\f``,
    ``\\x85``, ``\\u2028``..., where git sees one line)."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    return lines + [parts[-1]] if parts[-1] else lines


def split_patch(patch: str) -> list[tuple[list[str], str]]:
    """Split a git diff into ``(paths, section_text)`` per file, in order.

    ``paths`` holds every path the section touches: both sides of a rename or copy, and the
    ``---``/``+++`` names where they are more precise than the header. Text before the first
    ``diff --git`` line (a commit message, say) is dropped.
    """
    sections: list[tuple[list[str], str]] = []
    current: list[str] = []
    for line in _lines(patch):
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
                name = unquote_path(text[len(prefix):].split("\t", 1)[0])
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


# -- the form of a diff, as git writes it ---------------------------------------------
_EXTENDED_HEADERS = (b"old mode ", b"new mode ", b"deleted file mode ", b"new file mode ", b"copy from ",
                     b"copy to ", b"rename from ", b"rename to ", b"similarity index ", b"dissimilarity index ",
                     b"index ")
_HUNK_HEADER = re.compile(rb"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_BINARY_HUNK = re.compile(rb"(?:literal|delta) \d+")
_BASE85_LINE = re.compile(rb"[A-Za-z][0-9A-Za-z!#$%&()*+;<=>?@^_`{|}~-]+")
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def _control_character(line: bytes) -> Optional[str]:
    found = _CONTROL.search(line.decode("utf-8", errors="surrogateescape"))
    return None if found is None else repr(found.group())


def check_git_diff(data: bytes) -> Optional[str]:
    """Why ``data`` is not plain ``git diff --binary`` output (None when it is, or is empty).

    Lines end at ``\\n`` only, as git reads them. Refused: any text before the first
    ``diff --git`` line or between sections; a header line git would not write (``rename
    old``, a traditional ``---``/``+++`` pair after a section's hunks); a hunk with more or
    fewer lines than its ``@@`` header counts; control characters (other than tab) or
    Unicode line separators in any header line (git quotes such names). Hunk *content* is
    the files' own bytes and may hold anything.
    """
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    i = 0

    def problem(message: str) -> str:
        return f"line {i + 1}: {message}"

    def header(prefixes: tuple[bytes, ...]) -> bool:
        return i < len(lines) and lines[i].startswith(prefixes)

    while i < len(lines):
        if not lines[i].startswith(b"diff --git "):
            where = "before the first" if i == 0 else "after a section, not starting a new"
            return problem(f"text {where} `diff --git` section: {lines[i][:80]!r}")
        first = True
        while first or header(_EXTENDED_HEADERS):  # "diff --git", then git's extended headers
            bad = _control_character(lines[i])
            if bad:
                return problem(f"control character {bad} in a header line")
            i, first = i + 1, False
        if i >= len(lines) or lines[i].startswith(b"diff --git "):
            continue  # a section of headers only: a mode change, an empty file, a pure rename
        if lines[i].startswith(b"--- "):
            for prefix in (b"--- ", b"+++ "):
                if not header((prefix,)):
                    return problem(f"expected a {prefix.decode().strip()!r} line")
                bad = _control_character(lines[i])
                if bad:
                    return problem(f"control character {bad} in a header line")
                i += 1
            if not header((b"@@",)):
                return problem("a file header without hunks")
            while header((b"@@",)):
                match = _HUNK_HEADER.match(lines[i])
                if match is None:
                    return problem(f"not a hunk header: {lines[i][:80]!r}")
                old = 1 if match.group(1) is None else int(match.group(1))
                new = 1 if match.group(2) is None else int(match.group(2))
                i += 1
                while old > 0 or new > 0:
                    if i >= len(lines):
                        return problem("the diff ends inside a hunk")
                    tag = lines[i][:1]
                    if tag in (b" ", b""):  # an empty line is an empty context line, as git reads it
                        old, new = old - 1, new - 1
                    elif tag == b"-":
                        old -= 1
                    elif tag == b"+":
                        new -= 1
                    elif tag != b"\\":
                        return problem(f"a line the hunk does not account for: {lines[i][:80]!r}")
                    if old < 0 or new < 0:
                        return problem("a hunk longer than its header counts")
                    i += 1
                while header((b"\\",)):  # "\\ No newline at end of file"
                    i += 1
        elif lines[i] == b"GIT binary patch":
            i += 1
            for part in range(2):  # the forward data, then (optionally) the reverse
                if i < len(lines) and _BINARY_HUNK.fullmatch(lines[i]):
                    i += 1
                    while i < len(lines) and _BASE85_LINE.fullmatch(lines[i]):
                        i += 1
                    if i >= len(lines) or lines[i] != b"":
                        return problem("binary data not ended by an empty line")
                    i += 1
                elif part == 0:
                    return problem("`GIT binary patch` without `literal` or `delta` data")
        elif lines[i].startswith(b"Binary files ") and lines[i].endswith(b" differ"):
            bad = _control_character(lines[i])
            if bad:
                return problem(f"control character {bad} in a header line")
            i += 1
        else:
            return problem(f"not a git diff header line: {lines[i][:80]!r}")
    return None
