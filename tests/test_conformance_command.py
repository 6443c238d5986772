"""One command proves a backend: ``pytest -p orchard.testing --orchard-backend NAME`` (or
``orchard conformance NAME``) collects the whole suite with no test module to write."""

from __future__ import annotations

import re
import subprocess
import sys

TWO_TESTS = "test_exec_returns_output_and_exit_code or test_unknown_sandbox_is_a_typed_error"


def run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=300)


def test_the_plugin_alone_collects_the_whole_suite(tmp_path):
    result = run([sys.executable, "-m", "pytest", "-p", "orchard.testing", "--orchard-backend", "local",
                  "--collect-only", "-q", "-p", "no:cacheprovider"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    count = int(re.search(r"(\d+) tests? collected", result.stdout).group(1))
    assert count >= 28
    for module_test in ("test_create_get_list_delete[local]",  # conformance
                        "test_a_blocked_sandbox_reaches_no_network_not_even_host_loopback[local]",  # isolation
                        "test_upload_through_a_symlink_to_proc_sys_cannot_change_the_host[local]",  # hostile
                        "test_snapshots_fork_correctly_or_are_refused_by_name[local]"):  # snapshots
        assert module_test in result.stdout


def test_explicit_test_paths_are_left_alone(tmp_path):
    (tmp_path / "test_mine.py").write_text("def test_mine():\n    pass\n")
    result = run([sys.executable, "-m", "pytest", "-p", "orchard.testing", "--orchard-backend", "local", "-q",
                  "-p", "no:cacheprovider", "test_mine.py"], tmp_path)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout


def test_orchard_conformance_runs_the_suite_against_a_backend(tmp_path):
    result = run([sys.executable, "-m", "orchard.cli", "conformance", "local", "-q", "-p", "no:cacheprovider",
                  "-k", TWO_TESTS], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout
    assert "running: -m pytest -p orchard.testing --orchard-backend local" in result.stderr


def test_orchard_conformance_refuses_an_unknown_backend(tmp_path):
    result = run([sys.executable, "-m", "orchard.cli", "conformance", "nope"], tmp_path)
    assert result.returncode == 2 and "unknown backend 'nope'" in result.stderr
