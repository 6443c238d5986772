"""Reading git diffs and dropping protected files, checked against real git."""

from __future__ import annotations

import subprocess

import pytest

from orchard.tasks import DEFAULT_PROTECTED_PATHS, drop_protected, is_protected, patch_files, split_patch


def git(cwd, *args: str, stdin: str | None = None) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def repo(tmp_path):
    """A repository whose working tree differs from HEAD in source, tests, a rename and a new file."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "pkg" / "core.py").write_text("def f():\n    return 1\n")
    (tmp_path / "pkg" / "old name.py").write_text("X = 1\n")
    (tmp_path / "tests" / "test_core.py").write_text("from pkg.core import f\n\nassert f() == 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "commit", "-q", "-m", "x")
    (tmp_path / "pkg" / "core.py").write_text("def f():\n    return 2\n")
    (tmp_path / "tests" / "test_core.py").write_text("from pkg.core import f\n\nassert f() == 2\n")
    git(tmp_path, "mv", "pkg/old name.py", "pkg/new name.py")
    (tmp_path / "conftest.py").write_text("collect_ignore = ['tests']\n")
    (tmp_path / "pkg" / "tëst data.txt").write_text("quoted by git\n")
    git(tmp_path, "add", "-A")
    return tmp_path


def test_patch_files_reads_every_kind_of_section(repo):
    diff = git(repo, "diff", "--cached", "-M", "HEAD")
    assert set(patch_files(diff)) == {"pkg/core.py", "tests/test_core.py", "pkg/old name.py", "pkg/new name.py",
                                      "conftest.py", "pkg/tëst data.txt"}
    assert len(split_patch(diff)) == 5


def test_dropping_protected_files_leaves_a_patch_git_applies(repo):
    diff = git(repo, "diff", "--cached", "-M", "HEAD")
    kept, dropped = drop_protected(diff, DEFAULT_PROTECTED_PATHS)
    assert set(dropped) == {"tests/test_core.py", "conftest.py"}
    assert set(patch_files(kept)) == {"pkg/core.py", "pkg/old name.py", "pkg/new name.py", "pkg/tëst data.txt"}
    git(repo, "reset", "-q", "--hard", "HEAD")
    git(repo, "apply", "--check", "-", stdin=kept)
    git(repo, "apply", "-", stdin=kept)
    assert (repo / "pkg" / "core.py").read_text().endswith("return 2\n")
    assert (repo / "tests" / "test_core.py").read_text().endswith("== 1\n")  # the test edit was dropped
    assert not (repo / "conftest.py").exists()


def test_a_rename_out_of_a_protected_directory_is_dropped():
    diff = ("diff --git a/tests/test_x.py b/pkg/x.py\nsimilarity index 100%\n"
            "rename from tests/test_x.py\nrename to pkg/x.py\n")
    kept, dropped = drop_protected(diff, DEFAULT_PROTECTED_PATHS)
    assert kept == "" and dropped == ["tests/test_x.py"]


def test_text_before_the_first_section_is_ignored_and_empty_patches_are_fine():
    assert split_patch("From abc\nSubject: fix\n\n") == []
    assert drop_protected("", ["*"]) == ("", [])
    assert patch_files("diff --git a/a b/a\n--- a/a\n+++ b/a\n@@ -1 +1 @@\n-x\n+y") == ["a"]


def test_is_protected_uses_fnmatch_on_repository_paths():
    assert is_protected("./tests/a.py", ["tests/*"])
    assert is_protected("a/b/c_test.py", ["*_test.py"])
    assert not is_protected("Tests/a.py", ["tests/*"])  # case-sensitive everywhere
