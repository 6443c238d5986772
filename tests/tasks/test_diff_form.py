"""What counts as plain ``git diff`` output: real diffs of every kind pass, and each form the
hostile review used to make ``git apply`` read a diff differently from us is refused."""

from __future__ import annotations

import subprocess

import pytest

from orchard.tasks import patch_files
from orchard.tasks.patches import check_git_diff


def git(cwd, *args: str) -> bytes:
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def diff(tmp_path) -> bytes:
    """A staged diff with a text edit, a deletion, a mode change, a quoted name, a file without a
    final newline, an empty new file, a symlink, Latin-1 bytes and a binary file."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "core.py").write_text("def f():\n    return 1\n")
    (tmp_path / "gone.txt").write_text("bye\n")
    (tmp_path / "run.sh").write_text("echo\n")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "tail.txt").write_text("no newline")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "commit", "-q", "-m", "x")
    (tmp_path / "pkg" / "core.py").write_text("def f():\n\n    return 2\n")
    (tmp_path / "gone.txt").unlink()
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "blob.bin").write_bytes(bytes(range(255, -1, -1)) * 9)
    (tmp_path / "tail.txt").write_text("still no newline")
    (tmp_path / "pkg" / "tëst data.txt").write_text("quoted by git\n")
    (tmp_path / "pkg" / "latin.py").write_bytes(b"# caf\xe9\n")
    (tmp_path / "empty").write_text("")
    (tmp_path / "link").symlink_to("pkg/core.py")
    git(tmp_path, "add", "-A")
    return git(tmp_path, "diff", "--cached", "--binary", "--no-renames", "HEAD")


def test_real_git_diffs_of_every_kind_pass(diff, tmp_path):
    assert check_git_diff(diff) is None
    assert check_git_diff(b"") is None
    assert b"GIT binary patch" in diff and b"\\ No newline at end of file" in diff and b"\xe9" in diff
    renamed = git(tmp_path, "diff", "--cached", "--binary", "-M", "-C", "HEAD")
    assert check_git_diff(renamed) is None


NEUTER = (b"--- a/tests/test_x.py\n+++ b/tests/test_x.py\n@@ -1,2 +1,2 @@\n def test():\n"
          b"-    assert f() == 2\n+    pass\n")
HARMLESS = (b"diff --git a/pkg/core.py b/pkg/core.py\nindex 1111111..2222222 100644\n--- a/pkg/core.py\n"
            b"+++ b/pkg/core.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n")


@pytest.mark.parametrize("text,problem", [
    (b"From 123\nSubject: fix\n\n" + HARMLESS, "before the first"),
    (NEUTER + HARMLESS, "before the first"),  # a traditional diff first
    (HARMLESS + NEUTER, "not starting a new"),  # a traditional diff hidden after a section's hunks
    (HARMLESS.replace(b"@@ -1,2 +1,2 @@", b"@@ -1,1 +1,2 @@"), "hunk longer"),
    (HARMLESS.replace(b" def f():\n-", b" def f():\n ?\n-"), "not starting a new"),
    (HARMLESS.replace(b"+    return 2\n", b"+    return 2\n+    extra\n"), "not starting a new"),
    (HARMLESS[:-len(b"+    return 2\n")], "ends inside a hunk"),
    (b"diff --git a/pkg/x.py b/pkg/y.py\nsimilarity index 90%\nrename old tests/test_x.py\n"
     b"rename new tests/test_x.py\n" + NEUTER[NEUTER.index(b"@@"):], "not a git diff header"),
    (HARMLESS.replace(b"index 1111111..2222222 100644", b"index 1111111..2222222 100644\x0c@@"), "'\\x0c'"),
    (HARMLESS.replace(b"+++ b/pkg/core.py", "+++ b/pkg/core.py\x85".encode()), "'\\x85'"),
    (HARMLESS.replace(b"diff --git a/pkg/core.py b/pkg/core.py",
                      "diff --git a/pkg/core.py\u2028 b/pkg/core.py".encode()), "'\\u2028'"),
    (HARMLESS.replace(b"\n", b"\r\n"), "'\\r'"),
    (HARMLESS.replace(b"@@ -1,2 +1,2 @@", b"@@ -1,2 +1,2 @"), "not a hunk header"),
    (b"diff --git a/b.bin b/b.bin\nindex 1..2 100644\nGIT binary patch\nliteral 3\nKcmZ?wbN~PV\n",
     "not ended by an empty line"),
])
def test_what_is_not_plain_git_diff_output_is_refused(text, problem):
    found = check_git_diff(text)
    assert found is not None and problem in found, found


def test_file_names_are_read_from_lines_as_git_splits_them():
    """``str.splitlines`` splits at a form feed; git does not: one section, one file."""
    text = "diff --git a/a b/a\n--- a/a\n+++ b/a\n@@ -1 +1 @@\n-x\x0cdiff --git a/tests/t b/tests/t\n+y\n"
    assert patch_files(text) == ["a"]
