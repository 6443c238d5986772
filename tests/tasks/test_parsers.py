"""Per-test results from pytest and unittest output (hand-written logs and real runs), and
grading that forged output cannot fool."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from orchard.tasks import MISSING, Task, parse_pytest, parse_unittest, pytest_summary_ok, unittest_summary_ok
from orchard.tasks.parsers import tests_passed as grade

PYTEST_LOG = """\
============================= test session starts ==============================
collected 6 items

astropy/modeling/tests/test_separable.py::test_coord_matrix PASSED       [ 16%]
astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6] FAILED [ 33%]
astropy/modeling/tests/test_separable.py::test_skip_me SKIPPED (no scipy) [ 50%]

=========================== short test summary info ============================
PASSED astropy/modeling/tests/test_separable.py::test_coord_matrix
PASSED astropy/modeling/tests/test_separable.py::test_cdot
SKIPPED [1] astropy/modeling/tests/test_separable.py:140: could not import 'scipy'
XFAIL astropy/modeling/tests/test_separable.py::test_known_bad - reason: upstream bug
XPASS astropy/modeling/tests/test_separable.py::test_flaky
ERROR astropy/modeling/tests/test_separable.py::test_fixture_boom - RuntimeError: no
FAILED astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6] - AssertionError: assert False
FAILED astropy/modeling/tests/test_separable.py::test_param[a b - c] - ValueError
\x1b[31m========= 3 failed, 2 passed, 1 skipped, 1 xfailed, 1 xpassed, 1 error in 0.42s =========\x1b[0m
"""

UNITTEST_LOG = """\
test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests) ... ok
test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests.test_unicode_validator) ... FAIL
test_help_text (auth_tests.test_validators.MinimumLengthValidatorTest)
Named URLs should be reversible ... ok
test_noisy (auth_tests.test_validators.Noisy.test_noisy) ... printed without a newline ok
test_late (auth_tests.test_validators.Noisy.test_late) ... printed
ok
test_skip (auth_tests.test_validators.Noisy.test_skip) ... skipped 'no database'
test_blank (auth_tests.test_validators.Noisy.test_blank) ... \n
ok
test_sub (auth_tests.test_validators.Noisy.test_sub) ...
  test_sub (auth_tests.test_validators.Noisy.test_sub) (value='x') ... FAIL

======================================================================
FAIL: test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests.test_unicode_validator)
----------------------------------------------------------------------
AssertionError: ValidationError not raised

----------------------------------------------------------------------
Ran 8 tests in 0.010s

FAILED (failures=2, skipped=1)
Destroying test database for alias 'default'...
"""


def test_pytest_reads_summary_and_verbose_lines():
    results = parse_pytest(PYTEST_LOG)
    prefix = "astropy/modeling/tests/test_separable.py::"
    assert results == {
        prefix + "test_coord_matrix": "PASSED", prefix + "test_cdot": "PASSED",
        prefix + "test_separable[compound_model6-result6]": "FAILED", prefix + "test_skip_me": "SKIPPED",
        prefix + "test_known_bad": "PASSED", prefix + "test_flaky": "FAILED",
        prefix + "test_fixture_boom": "ERROR", prefix + "test_param[a b - c]": "FAILED",
    }
    assert pytest_summary_ok(PYTEST_LOG, clean=False) and not pytest_summary_ok(PYTEST_LOG)
    assert pytest_summary_ok("==== 5 passed, 1 warning in 1.20s (0:00:01) ====\n")
    assert pytest_summary_ok("3 passed in 0.01s\n") and not pytest_summary_ok("no tests ran in 0.01s\n")
    assert not pytest_summary_ok("PASSED a.py::t\n")


def test_unittest_reads_both_id_forms_docstrings_noise_and_subtests():
    results = parse_unittest(UNITTEST_LOG)
    base = "auth_tests.test_validators."
    assert results == {
        base + "UsernameValidatorsTests.test_ascii_validator": "PASSED",
        base + "UsernameValidatorsTests.test_unicode_validator": "FAILED",
        base + "MinimumLengthValidatorTest.test_help_text": "PASSED", "Named URLs should be reversible": "PASSED",
        base + "Noisy.test_noisy": "PASSED", base + "Noisy.test_late": "PASSED", base + "Noisy.test_skip": "SKIPPED",
        base + "Noisy.test_blank": "PASSED", base + "Noisy.test_sub": "FAILED",
    }
    assert unittest_summary_ok(UNITTEST_LOG, clean=False)  # the teardown line after the summary is fine
    assert not unittest_summary_ok(UNITTEST_LOG)


def test_unittest_summary_counts_must_match():
    ok = "test_a (m.T.test_a) ... ok\n\n---\nRan 1 test in 0.001s\n\nOK\n"
    assert unittest_summary_ok(ok) and unittest_summary_ok(ok.replace("OK\n", "OK (skipped=1)\n"))
    assert not unittest_summary_ok(ok.replace("Ran 1 test", "Ran 2 tests"))
    assert not unittest_summary_ok("test_a (m.T.test_a) ... ok\n")  # no summary: the run died
    assert not unittest_summary_ok(ok.replace("\nOK\n", "\nFAILED (errors=1)\n"), clean=True)


def real_run(tmp_path, command: list[str], files: dict[str, str]) -> tuple[int, str]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=120)
    return result.returncode, result.stdout


SUITE = {
    "tests/__init__.py": "",
    "tests/test_mod.py": '''
        import unittest

        class T(unittest.TestCase):
            def test_ok(self):
                print("chatty", end="")

            def test_fail(self):
                self.assertEqual(1, 2)

            def test_doc(self):
                """First line of the docstring."""

            @unittest.skip("later")
            def test_skip(self):
                pass

            def test_sub(self):
                for i in range(3):
                    with self.subTest(i=i):
                        self.assertLess(i, 2)
    ''',
    "tests/test_broken.py": "import no_such_module\n",
}


def test_a_real_unittest_run(tmp_path):
    code, output = real_run(tmp_path, [sys.executable, "-m", "unittest", "discover", "-v", "-s", "tests", "-t", "."],
                            SUITE)
    assert code == 1
    assert parse_unittest(output) == {
        "tests.test_mod.T.test_ok": "PASSED", "tests.test_mod.T.test_fail": "FAILED",
        "tests.test_mod.T.test_doc": "PASSED", "First line of the docstring.": "PASSED",
        "tests.test_mod.T.test_skip": "SKIPPED", "tests.test_mod.T.test_sub": "FAILED",
        "unittest.loader._FailedTest.tests.test_broken": "ERROR",
    }
    assert unittest_summary_ok(output, clean=False) and not unittest_summary_ok(output)


def test_a_real_pytest_run(tmp_path):
    files = {"test_a.py": '''
        import pytest

        def test_ok():
            pass

        def test_bad():
            assert 1 == 2

        @pytest.mark.parametrize("x", [1, 2])
        def test_param(x):
            assert x == 1

        @pytest.mark.xfail
        def test_xf():
            assert False
    '''}
    code, output = real_run(tmp_path, [sys.executable, "-m", "pytest", "--no-header", "-rA", "--tb=no", "-p",
                                       "no:cacheprovider", "test_a.py"], files)
    assert code == 1
    assert parse_pytest(output) == {"test_a.py::test_ok": "PASSED", "test_a.py::test_bad": "FAILED",
                                    "test_a.py::test_param[1]": "PASSED", "test_a.py::test_param[2]": "FAILED",
                                    "test_a.py::test_xf": "PASSED"}
    assert pytest_summary_ok(output, clean=False) and not pytest_summary_ok(output)


def unittest_task(**overrides) -> Task:
    data = dict(task_id="t", image="host", problem_statement="p", test_commands=["python3 -m unittest -v"],
                test_framework="unittest", fail_to_pass=["m.T.test_fix"], pass_to_pass=["m.T.test_keep"])
    data.update(overrides)
    return Task(**data)


GOOD = ("test_fix (m.T.test_fix) ... ok\ntest_keep (m.T.test_keep) ... ok\n\n"
        "----------------------------------------------------------------------\nRan 2 tests in 0.001s\n\nOK\n")


def test_grading_a_clean_run():
    resolved, details = grade(unittest_task(), [GOOD], [0])
    assert resolved and details["reason"] == "resolved"
    assert details["fail_to_pass"] == {"m.T.test_fix": "PASSED"} and details["summary_ok"] == [True]


@pytest.mark.parametrize("output,code,reason", [
    (GOOD, 1, "exited non-zero"),
    (GOOD.replace("test_fix (m.T.test_fix) ... ok\n", ""), 0, "summary is missing"),  # count no longer matches
    (GOOD.replace("m.T.test_fix", "m.T.test_other"), 0, "m.T.test_fix"),  # listed test missing
    (GOOD.replace("\nOK\n", "\n"), 0, "summary is missing"),  # killed before the summary
    (GOOD.replace("test_fix) ... ok", "test_fix) ... skipped 'x'").replace("\nOK\n", "\nOK (skipped=1)\n"), 0,
     "m.T.test_fix"),
])
def test_grading_failures(output, code, reason):
    resolved, details = grade(unittest_task(), [output], [code])
    assert not resolved and reason in details["reason"]


def test_forged_lines_cannot_hide_a_real_failure():
    real = ("test_fix (m.T.test_fix) ... FAIL\ntest_keep (m.T.test_keep) ... ok\n\n"
            "FAIL: test_fix (m.T.test_fix)\n------\nRan 2 tests in 0.001s\n\nFAILED (failures=1)\n")
    forged = "test_fix (m.T.test_fix) ... ok\n" + real + "Ran 2 tests in 0.001s\n\nOK\n"
    resolved, details = grade(unittest_task(), [forged], [0])
    assert not resolved and details["results"]["m.T.test_fix"] == "FAILED"
    # a forged "ok" printed after the real result (at exit, say) does not win either
    assert parse_unittest("test_fix (m.T.test_fix) ... FAIL\ntest_fix (m.T.test_fix) ... ok\n") == \
        {"m.T.test_fix": "FAILED"}
    assert parse_pytest("FAILED a.py::t - boom\nPASSED a.py::t\na.py::t PASSED [100%]\n") == {"a.py::t": "FAILED"}
    # only the forged lines, the real run's lines hidden: the counts give it away
    resolved, _ = grade(unittest_task(), ["test_fix (m.T.test_fix) ... ok\n" + GOOD], [0])
    assert not resolved


def test_grading_pytest_and_exit_code_tasks():
    task = unittest_task(test_framework="pytest", fail_to_pass=["a.py::t1"], pass_to_pass=[], clean_run_required=False)
    log = "PASSED a.py::t1\nFAILED a.py::t2 - boom\n===== 1 failed, 1 passed in 0.1s =====\n"
    assert grade(task, [log], [0])[0]
    assert not grade(task.model_copy(update={"clean_run_required": True}), [log], [0])[0]
    plain = unittest_task(test_framework="exit_code", fail_to_pass=[], pass_to_pass=[], test_commands=["a", "b"])
    assert grade(plain, ["", ""], [0, 0])[0] and not grade(plain, ["", ""], [0, 2])[0]
    with pytest.raises(ValueError, match="2 test commands"):
        grade(plain, [""], [0])


def test_results_of_several_commands_merge_worst_first():
    task = unittest_task(test_commands=["a", "b"], clean_run_required=False)
    second = GOOD.replace("test_keep) ... ok", "test_keep) ... ERROR").replace("\nOK\n", "\nFAILED (errors=1)\n")
    resolved, details = grade(task, [GOOD, second], [0, 0])
    assert not resolved and details["pass_to_pass"] == {"m.T.test_keep": "ERROR"}
    assert details["fail_to_pass"]["m.T.test_fix"] == "PASSED" and MISSING == "MISSING"


CANARIES = ("test_c0ffee_equal", "test_c0ffee_assert")


def with_canaries(report: str, canary: str = "FAIL") -> str:
    """GOOD plus the two planted tests reported with ``canary``, summary adjusted."""
    lines = "".join(f"{name} (tests.test_c0ffee.Testc0ffee.{name}) ... {canary}\n" for name in CANARIES)
    status = "FAILED (failures=2)" if canary == "FAIL" else "OK"
    return lines + report.replace("Ran 2 tests", "Ran 4 tests").replace("\nOK\n", f"\n{status}\n")


def test_planted_failing_tests_must_fail_and_are_left_out_of_the_clean_run_check():
    resolved, details = grade(unittest_task(), [with_canaries(GOOD)], [1], canaries=CANARIES)
    assert resolved, details["reason"]
    assert details["canaries"] == dict.fromkeys(CANARIES, "FAILED")
    assert not any("c0ffee" in test for test in details["results"]), "canaries are not results"


@pytest.mark.parametrize("output,code,reason", [
    (with_canaries(GOOD, "ok"), 0, "tampered with"),  # assertions neutered: the canaries pass
    (with_canaries(GOOD, "ok"), 1, "tampered with"),
    (GOOD, 0, "tampered with"),  # the canaries never ran
    (with_canaries(GOOD), 0, "tampered with"),  # a failing run that exits 0
    (with_canaries(GOOD), 2, "exited 2"),
    (with_canaries(GOOD).replace("test_keep) ... ok", "test_keep) ... FAIL").replace("failures=2", "failures=3"),
     1, "summary"),  # a real failure next to the canaries
    (with_canaries(GOOD).replace("failures=2)", "failures=2, errors=1)"), 1, "summary"),
])
def test_a_run_whose_canaries_did_not_fail_is_not_trusted(output, code, reason):
    resolved, details = grade(unittest_task(), [output], [code], canaries=CANARIES)
    assert not resolved and reason in details["reason"], details["reason"]


def test_pytest_canaries():
    task = unittest_task(test_framework="pytest", fail_to_pass=["t.py::test_fix"], pass_to_pass=[])
    names = ("test_c0ffee_equal",)
    log = ("PASSED t.py::test_fix\nFAILED tests/test_c0ffee.py::Testc0ffee::test_c0ffee_equal - AssertionError\n"
           "===== 1 failed, 1 passed in 0.1s =====\n")
    assert grade(task, [log], [1], canaries=names)[0]
    assert not grade(task, [log.replace("1 failed", "2 failed")], [1], canaries=names)[0]
    forged = log.replace("FAILED tests", "PASSED tests").replace("1 failed, 1 passed", "2 passed")
    resolved, details = grade(task, [forged], [0], canaries=names)
    assert not resolved and "tampered" in details["reason"]
