"""Read per-test results from test output, and decide whether a task is resolved.

Grading must be hard to fool: the agent controls the code under test, and that code can
print anything. So a test counts only when the runner's own result line says PASSED; when a
test is reported twice, the worse status wins (a forged "ok" cannot hide a real "FAIL"); a
listed test missing from the output is not passed; every command must exit 0; and the
runner's final summary must be there (for unittest, with as many tests as there are result
lines, which forged extra lines break) and, unless ``Task.clean_run_required`` is off (SWE-bench
tasks, whose test files hold tests that fail regardless), report no failures.

Grading may plant *canaries* (``canaries`` in :func:`tests_passed`): tests that must fail.
Each must be reported FAILED, the run must exit 1 and report exactly that many failures (and
no errors); a canary that passed or is missing means the runner was tampered with. Canaries
are left out of the results and of the clean-run check.

Test ids are pytest node ids (``tests/test_a.py::TestX::test_y[param]``) and, for unittest,
``module.Class.test_name`` whatever the Python version printed.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from orchard.tasks.task import Task

STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED")  # what the parsers report per test
MISSING = "MISSING"  # what grading reports for a listed test the output never named
_RANK = {"PASSED": 0, "SKIPPED": 1, "FAILED": 2, "ERROR": 3}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# pytest: "-rA" summary lines ("PASSED id", "FAILED id - msg") and "-v" lines ("id PASSED [ 50%]").
_PYTEST_WORDS = {"PASSED": "PASSED", "FAILED": "FAILED", "ERROR": "ERROR", "SKIPPED": "SKIPPED",
                 "XFAIL": "PASSED", "XPASS": "FAILED"}
_PYTEST_STATUS_FIRST = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (.+)$")
_PYTEST_STATUS_LAST = re.compile(r"^(\S+::.*?|\S+\.py) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \(.*\))?"
                                 r"(?: +\[ *\d+%\])? *$")
_PYTEST_PARAM_ID = re.compile(r"^(\S*?\[.*?\])(?= - |$)")  # "t[a - b] - msg": the id is "t[a - b]"
_PYTEST_SUMMARY = re.compile(r"^=* ?((?:\d+ [a-z]+(?:, )?)+) in [\d.]+s(?: \([^)]*\))? ?=*$")

# unittest -v: "test_x (pkg.mod.Class.test_x) ... ok" (3.11+) or "test_x (pkg.mod.Class) ... ok".
_UNITTEST_HEAD = re.compile(r"\b(\w+) \(([\w.]+)\)$")
_UNITTEST_SUBTEST = re.compile(r"\b(\w+) \(([\w.]+)\) \(.*\)$")  # "test_x (m.C.test_x) (i=2) ... FAIL"
_UNITTEST_DETAIL = re.compile(r"^(FAIL|ERROR|UNEXPECTED SUCCESS): (\w+) \(([\w.]+)\)")
_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in [\d.]+s$")
_UNITTEST_COUNTS = re.compile(r"(failures|errors|skipped|expected failures|unexpected successes)=(\d+)")
_UNITTEST_OK = re.compile(r"^OK(?: \((?:skipped|expected failures|unexpected successes)=\d+"
                          r"(?:, (?:skipped|expected failures|unexpected successes)=\d+)*\))?$")


def _merge(results: dict[str, str], test_id: str, status: str) -> None:
    """Record a status; the worse of two reports of the same test wins."""
    old = results.get(test_id)
    if old is None or _RANK[status] > _RANK[old]:
        results[test_id] = status


def parse_pytest(output: str) -> dict[str, str]:
    """``{node id: status}`` from pytest output run with ``-rA`` and/or ``-v``.

    ``SKIPPED [1] path:line: reason`` summary lines name no test and are ignored. XFAIL counts
    as PASSED and XPASS as FAILED, as the SWE-bench harness grades them.
    """
    results: dict[str, str] = {}
    for raw in output.splitlines():
        line = _ANSI.sub("", raw).rstrip()
        match = _PYTEST_STATUS_FIRST.match(line)
        if match:
            word, rest = match.groups()
            if word == "SKIPPED" and rest.startswith("["):
                continue
            param = _PYTEST_PARAM_ID.match(rest)
            test_id = param.group(1) if param else rest.split(" - ", 1)[0].strip()
            if test_id:
                _merge(results, test_id, _PYTEST_WORDS[word])
            continue
        match = _PYTEST_STATUS_LAST.match(line)
        if match:
            _merge(results, match.group(1), _PYTEST_WORDS[match.group(2)])
    return results


def pytest_summary_ok(output: str, clean: bool = True, failures: int = 0) -> bool:
    """Whether pytest's final summary line is there and (``clean``) counts no errors and
    exactly ``failures`` failures (the planted canaries; 0 without)."""
    summary = None
    for raw in output.splitlines():
        match = _PYTEST_SUMMARY.match(_ANSI.sub("", raw).strip())
        if match:
            summary = match.group(1)
    if summary is None:
        return False
    counts: Counter = Counter()
    for part in summary.split(", "):
        number, word = part.split(" ", 1)
        counts[word] += int(number)
    return not clean or (counts["failed"] == failures and not counts["error"] + counts["errors"] + counts["xpassed"])


def _unittest_id(name: str, where: str) -> str:
    return where if where.endswith("." + name) else f"{where}.{name}"


_STATUS_SUFFIX = re.compile(r"(ok|FAIL|ERROR|expected failure|unexpected success|skipped '.*'|skipped)$")


def _unittest_status(text: str, suffix: bool = False) -> str | None:
    """The status word unittest printed; ``suffix``: also at the end of text the test printed
    without a newline ("test_x (m.C.test_x) ... hellook")."""
    text = text.strip()
    if suffix:
        match = _STATUS_SUFFIX.search(text)
        text = match.group(1) if match else text
    if text == "ok" or text == "expected failure":
        return "PASSED"
    if text == "FAIL" or text == "unexpected success":
        return "FAILED"
    if text == "ERROR":
        return "ERROR"
    if text.startswith("skipped"):
        return "SKIPPED"
    return None


def _unittest_scan(output: str) -> tuple[dict[str, str], int]:
    """Results by id (and by docstring description, as SWE-bench names Django's tests) and the
    number of result lines seen."""
    results: dict[str, str] = {}
    lines = 0
    counted: set[str] = set()  # tests counted through their subtest lines
    pending: list[str] = []  # ids whose status follows on a later line (output in between, or a docstring)
    for raw in output.splitlines():
        line = _ANSI.sub("", raw).rstrip()
        if line.endswith(" ..."):  # the status comes on a later line
            line += " "
        detail = _UNITTEST_DETAIL.match(line)
        if detail:
            kind, name, where = detail.groups()
            _merge(results, _unittest_id(name, where), "ERROR" if kind == "ERROR" else "FAILED")
            continue
        if " ... " in line:
            before, _, after = line.rpartition(" ... ")
            head = _UNITTEST_HEAD.search(before)
            sub = None if head else _UNITTEST_SUBTEST.search(before)
            if sub and _unittest_status(after, suffix=True):  # a failing subtest: its test counts once in "Ran N"
                test_id = _unittest_id(*sub.groups())
                _merge(results, test_id, _unittest_status(after, suffix=True) or "ERROR")
                lines += test_id not in counted
                counted.add(test_id)
                pending = []
                continue
            ids = [_unittest_id(*head.groups())] if head else []
            if not ids and pending:  # "description ... ok" after a "test_x (m.C.test_x)" line
                ids = [pending[-1], before.strip()]
            status = _unittest_status(after, suffix=True)
            if ids and status:
                for test_id in ids:
                    _merge(results, test_id, status)
                lines += 1
                pending = []
            elif ids:
                pending = ids
            continue
        head = _UNITTEST_HEAD.match(line.strip())
        if head:
            pending = [_unittest_id(*head.groups())]
            continue
        status = _unittest_status(line) if pending and line.strip() in ("ok", "FAIL", "ERROR") else None
        if status:
            for test_id in pending:
                _merge(results, test_id, status)
            lines += 1
            pending = []
    return results, lines


def parse_unittest(output: str) -> dict[str, str]:
    """``{module.Class.test_name: status}`` from ``python -m unittest -v`` (or Django's runner
    at verbosity 2); ``FAIL:``/``ERROR:`` detail headers count too."""
    return _unittest_scan(output)[0]


def unittest_summary_ok(output: str, clean: bool = True, failures: int = 0) -> bool:
    """Whether the run printed its summary (``Ran N tests`` then ``OK``, or with ``clean=False``
    also ``FAILED (...)``), and ran exactly as many tests as it printed result lines for.
    ``clean``: never ``FAILED`` (with ``failures``, the planted canaries: ``FAILED`` with
    exactly that many failures, no errors and no unexpected successes). Lines after the
    summary (Django's teardown) are ignored."""
    ran, status, expecting, failed, counts = 0, "", False, False, Counter()
    for raw in output.splitlines():
        line = _ANSI.sub("", raw).strip()
        match = _UNITTEST_RAN.match(line)
        if match:
            ran, status, expecting = ran + int(match.group(1)), "", True
            continue
        is_failed = line.startswith("FAILED (") and line.endswith(")")
        failed = failed or is_failed
        if is_failed:
            for word, number in _UNITTEST_COUNTS.findall(line):
                counts[word] += int(number)
        if expecting and line:
            status, expecting = ("FAILED" if is_failed else "OK" if _UNITTEST_OK.match(line) else "?"), False
    if ran == 0 or status not in ("OK", "FAILED"):
        return False
    if clean and failures == 0 and (status != "OK" or failed):
        return False
    if clean and failures and (status != "FAILED" or counts["failures"] != failures or counts["errors"]
                               or counts["unexpected successes"]):
        return False
    return _unittest_scan(output)[1] == ran


def parse_test_output(framework: str, output: str) -> dict[str, str]:
    """Per-test results for a framework name (``exit_code`` names no tests)."""
    if framework == "pytest":
        return parse_pytest(output)
    if framework == "unittest":
        return parse_unittest(output)
    if framework == "exit_code":
        return {}
    raise ValueError(f"unknown test framework {framework!r}")


def _summary_ok(framework: str, output: str, clean: bool, failures: int = 0) -> bool:
    if framework == "pytest":
        return pytest_summary_ok(output, clean, failures)
    if framework == "unittest":
        return unittest_summary_ok(output, clean, failures)
    return True


def _test_name(test_id: str) -> str:
    """The function's name in a pytest node id or a unittest id (parameters dropped)."""
    return re.split(r"::|\.", test_id.split("[", 1)[0])[-1]


def tests_passed(task: "Task", outputs: Sequence[str], exit_codes: Sequence[int],
                 canaries: Sequence[str] = ()) -> tuple[bool, dict]:
    """Whether the outputs of ``task.test_commands`` (one per command, in order) resolve the task.

    Resolved iff every command exited 0, each output ends with the runner's summary (clean,
    unless ``task.clean_run_required`` is False), and every fail_to_pass and pass_to_pass id is
    PASSED in the merged results. ``canaries``: names of planted tests (in every command's
    run) that must fail: each is reported FAILED, every command exits 1 and the clean summary
    counts exactly those failures; otherwise the run is not trusted. The dict says why:
    ``reason``, ``exit_codes``, ``summary_ok``, ``results`` (canaries left out), ``canaries``,
    and the status of each listed id (``MISSING`` when the output never named it).
    """
    if len(outputs) != len(task.test_commands) or len(exit_codes) != len(task.test_commands):
        raise ValueError(f"{task.task_id}: {len(task.test_commands)} test commands, but {len(outputs)} outputs "
                         f"and {len(exit_codes)} exit codes")
    results: dict[str, str] = {}
    for output in outputs:
        for test_id, status in parse_test_output(task.test_framework, output).items():
            _merge(results, test_id, status)
    planted = {test_id: results.pop(test_id) for test_id in list(results) if _test_name(test_id) in canaries}
    canary_status = {name: max((s for t, s in planted.items() if _test_name(t) == name), key=_RANK.get,
                               default=MISSING) for name in canaries}
    summary_ok = [_summary_ok(task.test_framework, output, task.clean_run_required, len(canaries))
                  for output in outputs]
    f2p = {test_id: results.get(test_id, MISSING) for test_id in task.fail_to_pass}
    p2p = {test_id: results.get(test_id, MISSING) for test_id in task.pass_to_pass}
    failing = [t for t, s in {**f2p, **p2p}.items() if s != "PASSED"]
    tampered = [f"{name} {status}" for name, status in canary_status.items() if status != "FAILED"]
    if tampered:
        reason = f"the test runner was tampered with: a planted test that must fail was not failed ({tampered[0]})"
    elif canaries and any(code == 0 for code in exit_codes):
        reason = "the test runner was tampered with: it exited 0 although a planted test failed"
    elif not canaries and any(code != 0 for code in exit_codes):
        reason = "a test command exited non-zero"
    elif canaries and any(code != 1 for code in exit_codes):
        reason = f"a test command exited {max(exit_codes)}, not 1 (its planted failing tests)"
    elif not all(summary_ok):
        reason = "a test run's summary is missing" + (" or reports failures" if task.clean_run_required else "")
    elif failing:
        reason = f"{len(failing)} listed test(s) not passed: {', '.join(failing[:5])}"
    else:
        reason = "resolved"
    details = {"reason": reason, "exit_codes": list(exit_codes), "summary_ok": summary_ok, "results": results,
               "canaries": canary_status, "fail_to_pass": f2p, "pass_to_pass": p2p}
    return reason == "resolved", details


tests_passed.__test__ = False  # type: ignore[attr-defined]  # a grader, not a test: pytest must not collect it
