"""Grading a model cannot tamper with: whatever the rollout sandbox holds, only a diff git
reads as touching no protected path reaches a fresh fork of the task's starting state, and
a runner that passes everything is caught by a test planted there that must fail."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest

from orchard.client.aio import AsyncClient
from orchard.rollout.engine import EngineConfig, RolloutEngine
from orchard.rollout.environment import PreparedTask, TaskSetupFailed
from orchard.rollout.grading import MAX_DIFF_BYTES, _download_capped, extract_diff, grade, plan_canary, shadows
from orchard.rollout.policies.oracle import NoisyOraclePolicy
from orchard.rollout.sample import RolloutStatus
from orchard.tasks import Task
from orchard.tasks.generated import generate_suite
from orchard.tasks.parsers import tests_passed


def fake_runner(task) -> str:
    """A stand-in for unittest that reports every listed test as passed, as the real one would."""
    lines = []
    for test_id in task.fail_to_pass + task.pass_to_pass:
        name = test_id.rsplit(".", 1)[1]
        lines.append(f"{name} ({test_id}) ... ok")
    report = "\n".join(lines) + f"\n\n{'-' * 70}\nRan {len(lines)} tests in 0.001s\n\nOK\n"
    return f"import sys\nsys.stderr.write({report!r})\nraise SystemExit(0)\n"


def package(task) -> str:
    """The package under test of a generated task ("" for a task without one)."""
    return next((name.split("/")[0] for name in task.files if name.endswith("/__init__.py") and "test" not in name), "")


TAMPERING = {
    "nothing": "true",
    "delete the tests": "rm -rf tests",
    "neuter the assertions": "sed -i 's/self\\.assert[A-Za-z]*(/(lambda *a, **k: None)(/' tests/test_*.py",
    "a fake python3 on PATH": "mkdir -p /usr/local/bin && printf '#!/bin/sh\\necho OK\\nexit 0\\n' > "
                              "/usr/local/bin/python3 && chmod +x /usr/local/bin/python3 && "
                              "cp /usr/local/bin/python3 /usr/bin/python3 2>/dev/null; true",
    "a passed marker": "echo PASSED > .orchard-result && echo resolved > /tmp/passed && touch tests/PASSED",
    "a module shadowing unittest": "cat > unittest.py <<'EOF'\n{fake_runner}EOF",
    "a conftest and a pytest.ini": "printf 'raise SystemExit(0)\\n' > conftest.py && printf '[pytest]\\n' > pytest.ini",
    "the git repository removed": "rm -rf .git",
    "git history rewritten": "git -c user.email=x@x -c user.name=x commit -qam 'pretend' --allow-empty && "
                             "rm -rf tests && git add -A && git -c user.email=x@x -c user.name=x commit -qm gone",
    # git's own configuration changes the names in its diff: extraction pins the a/ b/ prefixes
    "diff.noprefix and x/unittest.py": "git config diff.noprefix true && mkdir x && "
                                       "cat > x/unittest.py <<'EOF'\n{fake_runner}EOF",
    "diff.mnemonicPrefix and unittest.py": "git config diff.mnemonicPrefix true && "
                                           "cat > unittest.py <<'EOF'\n{fake_runner}EOF",
    "a sourceless unittest.pyc": "cat > /tmp/u.py <<'EOF'\n{fake_runner}EOF\npython3 -c \"import py_compile; "
                                 "py_compile.compile('/tmp/u.py', cfile='unittest.pyc')\" && git add -f unittest.pyc",
    "a pyproject.toml": "printf '[tool.pytest.ini_options]\\naddopts = \"-p evil\"\\n' > pyproject.toml",
    # code under test turns every assertion into a no-op: only the canary can tell
    "assertions neutered by the package": "cat >> {package}/__init__.py <<'EOF'\nimport unittest as _u\n"
                                          "for _n in [n for n in dir(_u.TestCase) if n.startswith('assert')]:\n"
                                          "    setattr(_u.TestCase, _n, lambda *a, **k: None)\nEOF",
}
REFUSED = {  # tampering -> a path the refusal names
    "delete the tests": "tests/", "neuter the assertions": "tests/", "a module shadowing unittest": "unittest.py",
    "a conftest and a pytest.ini": "conftest.py", "diff.mnemonicPrefix and unittest.py": "unittest.py",
    "a sourceless unittest.pyc": "unittest.pyc", "a pyproject.toml": "pyproject.toml",
}


@pytest.fixture(scope="module")
def tasks(kit_image):
    return generate_suite(6, seed=11, image=kit_image)


def _grades(orchard_backend_settings, task, commands: dict[str, str], fix: bool) -> dict:
    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            async with PreparedTask(client, task) as prepared:
                assert prepared.forks, "the kit image has a writable layer: rollouts fork the prepared state"
                found = {}
                for name, command in commands.items():
                    sandbox = await prepared.sandbox()
                    try:
                        if fix:
                            await sandbox.exec("git apply -", stdin=task.reference_patch, cwd=task.workdir, check=True)
                        await sandbox.exec(command.format(fake_runner=fake_runner(task), package=package(task)),
                                           cwd=task.workdir)
                        diff = await extract_diff(sandbox, task)
                    finally:
                        await sandbox.delete()
                    found[name] = await grade(prepared, diff)
                return found
    return asyncio.run(main())


def test_no_tampering_earns_a_reward(orchard_backend_settings, tasks):
    task = tasks[0]
    grades = _grades(orchard_backend_settings, task, TAMPERING, fix=False)
    for name, result in grades.items():
        assert not result.resolved, f"{name!r} was graded resolved: {result.detail}"
    for name, path in REFUSED.items():
        result = grades[name]
        assert result.detail.startswith("the diff was refused"), (name, result.detail)
        assert any(p.startswith(path) for p in result.dropped_paths), (name, result.dropped_paths)
    assert {"conftest.py", "pytest.ini"} <= set(grades["a conftest and a pytest.ini"].dropped_paths)
    assert "tampered with" in grades["assertions neutered by the package"].detail


def test_a_real_fix_is_refused_with_tampering_of_the_judge_and_resolved_without(orchard_backend_settings, tasks):
    """A diff that touches a protected or shadowing path is refused whole, the fix in it too:
    tampering earns -1 even next to a real fix. Tampering outside the diff changes nothing."""
    task = tasks[1]
    kept = {name: TAMPERING[name] for name in ("nothing", "delete the tests", "neuter the assertions",
                                                "a fake python3 on PATH", "a module shadowing unittest",
                                                "diff.noprefix and x/unittest.py")}
    grades = _grades(orchard_backend_settings, task, kept, fix=True)
    for name in ("nothing", "a fake python3 on PATH", "diff.noprefix and x/unittest.py"):
        result = grades[name]
        assert result.resolved, f"the reference fix with {name!r} was not resolved: {result.detail}"
        assert all(status == "PASSED" for test, status in result.tests.items() if test in task.fail_to_pass)
        assert result.tests and not any(re.search(r"test_[0-9a-f]{16}", test) for test in result.tests), \
            "the planted tests are not among the results"
    for name in ("delete the tests", "neuter the assertions", "a module shadowing unittest"):
        result = grades[name]
        assert not result.resolved and result.detail.startswith("the diff was refused"), (name, result.detail)


def _host_repo(task, root):
    """The task's starting repository, built here with the host's git."""
    for name, text in task.files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for command in task.setup:
        subprocess.run(command, shell=True, cwd=root, check=True, capture_output=True)
    return root


def _diff_of(root, edit: str, *options: str) -> str:
    subprocess.run(edit, shell=True, cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    diff = subprocess.run(["git", *options, "diff", "--cached", "--binary", "HEAD"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    subprocess.run("git reset -q --hard HEAD && git clean -qfdx", shell=True, cwd=root, check=True)
    return diff


def test_a_diff_git_reads_differently_from_its_text_is_refused(orchard_backend_settings, tasks, tmp_path):
    """Each form the review used to slip an edit of the tests (or a module shadowing unittest)
    past a filter that parsed the diff's text, while ``git apply`` read it otherwise."""
    task = tasks[0]
    root = _host_repo(task, tmp_path)
    target = "tests/" + task.fail_to_pass[0].split(".")[1] + ".py"
    harmless = _diff_of(root, f"echo '# touched' >> {package(task)}/__init__.py")
    neuter = _diff_of(root, f"sed -i 's/self\\.assert[A-Za-z]*(/(lambda *a, **k: None)(/' {target}")
    traditional = "".join(line for line in neuter.splitlines(True) if not line.startswith(("diff --git", "index ")))
    hunks = neuter[neuter.index("@@"):]
    crafted = {
        "a traditional diff hidden after a section's hunk": harmless + traditional,
        "a traditional diff before the first section": traditional + harmless,
        "legacy rename old/new names": (f"diff --git a/{package(task)}/x.py b/{package(task)}/y.py\n"
                                        f"similarity index 90%\nrename old {target}\nrename new {target}\n" + hunks),
        "a form feed hiding the file names": (f"diff --git a/{package(task)}/a.py b/{package(task)}/b.py\n"
                                              f"index 1111111..2222222\x0c@@\n--- a/{target}\n+++ b/{target}\n"
                                              + hunks),
        "names without a/ b/ (diff.noprefix)": _diff_of(root, f"mkdir x && cat > x/unittest.py <<'EOF'\n"
                                                              f"{fake_runner(task)}EOF", "-c", "diff.noprefix=true"),
    }

    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            async with PreparedTask(client, task) as prepared:
                return {name: await grade(prepared, diff) for name, diff in crafted.items()}

    grades = asyncio.run(main())
    for name, result in grades.items():
        assert not result.resolved and result.detail.startswith("the diff was refused"), (name, result.detail)
    assert grades["names without a/ b/ (diff.noprefix)"].dropped_paths == ["unittest.py"], \
        "git's reading: -p1 turns x/unittest.py into a top-level unittest.py"


def test_a_diff_file_too_large_or_not_a_regular_file_earns_minus_one_unread(orchard_backend_settings, tasks):
    """A fake git makes the diff file huge (sparse), a link to a huge file, or /dev/zero: the
    rollout is graded -1 with the reason, and nothing near that size is read."""
    task = tasks[4]
    fakes = {
        "a sparse file": "truncate -s 1G \"$out\"",
        "a link to a sparse file": "rm -f \"$out\"; truncate -s 1G /tmp/.sparse; ln -s /tmp/.sparse \"$out\"",
        "a link to /dev/zero": "rm -f \"$out\"; ln -s /dev/zero \"$out\"",
    }

    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            async with PreparedTask(client, task) as prepared:
                found = {}
                for name, action in fakes.items():
                    fake = ('#!/bin/sh\ncase "$*" in *"diff --cached"*) out=$(readlink /proc/$$/fd/1); '
                            f"{action};; *) exec /usr/bin/git \"$@\";; esac\n")
                    sandbox = await prepared.sandbox()
                    try:
                        await sandbox.exec("mkdir -p /usr/local/bin && cat > /usr/local/bin/git && "
                                           "chmod +x /usr/local/bin/git", stdin=fake, check=True)
                        began = time.monotonic()
                        diff = await extract_diff(sandbox, task)
                        found[name] = (await grade(prepared, diff), time.monotonic() - began)
                    finally:
                        await sandbox.delete()
                sandbox = await prepared.sandbox()
                try:  # a file that grows past the cap after any size check: the stream stops at the cap
                    await sandbox.exec(f"head -c {MAX_DIFF_BYTES + 1} /dev/zero > /tmp/big", check=True)
                    capped = await _download_capped(sandbox, "/tmp/big", MAX_DIFF_BYTES)
                    whole = await _download_capped(sandbox, "/tmp/big", MAX_DIFF_BYTES + 1)
                finally:
                    await sandbox.delete()
                return found, capped, whole

    found, capped, whole = asyncio.run(main())
    for name, (result, seconds) in found.items():
        assert not result.resolved and result.detail.startswith("the diff was refused"), (name, result.detail)
        assert seconds < 30, f"{name}: {seconds:.1f} s: the file was read"
    assert "more than" in found["a sparse file"][0].detail
    assert "not a regular file" in found["a link to a sparse file"][0].detail
    assert capped is None and whole is not None and len(whole) == MAX_DIFF_BYTES + 1


def test_a_fix_to_a_file_that_is_not_utf8_is_graded_byte_for_byte(orchard_backend_settings, kit_image):
    task = Task(task_id="latin1", image=kit_image, problem_statement="make f() return 2",
                setup=["printf '# caf\\351\\ndef f():\\n    return 1\\n' > m.py", "git init -q", "git add -A",
                       "git -c user.email=t@t -c user.name=t -c commit.gpgsign=false commit -qm b"],
                test_commands=["python3 -c 'import m; assert m.f() == 2'"])
    grades = _grades(orchard_backend_settings, task, {"the fix": "sed -i 's/return 1/return 2/' m.py"}, fix=False)
    assert grades["the fix"].resolved, grades["the fix"].detail


def test_new_files_in_a_directory_the_repository_has_are_not_shadowing(orchard_backend_settings, kit_image):
    """``html/`` is named like a stdlib package, but the repository had it: adding to it is fine."""
    task = Task(task_id="html-dir", image=kit_image, problem_statement="add html/new.txt",
                setup=["mkdir html && echo a > html/index.txt", "git init -q", "git add -A",
                       "git -c user.email=t@t -c user.name=t -c commit.gpgsign=false commit -qm b"],
                test_commands=["test -f html/new.txt"])
    grades = _grades(orchard_backend_settings, task, {"a new file there": "echo b > html/new.txt",
                                                      "a new package": "mkdir json && touch json/__init__.py"},
                     fix=False)
    assert grades["a new file there"].resolved, grades["a new file there"].detail
    assert grades["a new package"].dropped_paths == ["json/__init__.py"]


def test_two_tasks_under_one_id_are_graded_each_by_its_own_tests(orchard_backend_settings, tasks):
    task = tasks[5]
    impossible = task.model_copy(update={"test_commands": ["exit 1"], "test_framework": "exit_code",
                                         "fail_to_pass": [], "pass_to_pass": []})

    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            oracle = NoisyOraclePolicy([task], p=1.0)
            async with RolloutEngine(client, oracle, EngineConfig(max_concurrent=1)) as engine:
                return await engine.rollout(task), await engine.rollout(impossible)

    first, second = asyncio.run(main())
    assert first.reward == 1.0
    assert second.reward == -1.0 and not second.grade.cached, second.grade.detail


def test_new_top_level_entries_that_shadow_the_runner():
    for path in ("unittest", "unittest.py", "unittest.pyc", "unittest.cpython-311-x86_64-linux-gnu.so",
                 "unittest.abi3.so", "re/__init__.py", "pytest/__init__.py", "evil.pth",
                 "x.dist-info/entry_points.txt", "x.egg-info/entry_points.txt", "x.egg-link"):
        assert shadows(path), path
    for path in ("pkg/unittest.py", "mymodule.py", "README.md", "types.md", "pkg/x.pth.txt", "x/unittest.pyc"):
        assert not shadows(path), path


def test_where_a_canary_is_planted(tasks):
    canary = plan_canary(tasks[0])
    assert canary is not None and canary.commands == tasks[0].test_commands
    assert canary.path.startswith("tests/test_") and canary.path.endswith(".py") and len(canary.names) == 2
    assert all(name in canary.source for name in canary.names) and plan_canary(tasks[0]).path != canary.path
    pytest_task = tasks[0].model_copy(update={"test_framework": "pytest",
                                              "test_commands": ["python3 -m pytest -rA --tb=no -p no:cacheprovider "
                                                                "tests/test_a.py"]})
    planted = plan_canary(pytest_task)
    assert planted is not None and planted.commands == [f"{pytest_task.test_commands[0]} {planted.path}"]
    assert planted.path.startswith("tests/test_")
    for command, framework in (("python3 -B -u -m unittest discover -s tests", "unittest"),
                               ("python -B -m pytest tests", "pytest")):
        assert plan_canary(tasks[0].model_copy(update={"test_commands": [command],
                                                       "test_framework": framework})) is not None, command
    for command in ("python3 -m unittest discover -f -s tests",  # failfast: the canary would stop the run
                    "python3 -m unittest discover -s tests -p '*_check.py'", "python3 -m unittest -v",
                    "python3 -m unittest discover -s tests 2>&1 | tail -n 1", "pytest -x tests", "pytest -k fix tests",
                    "pytest tests/test_a.py::test_one", "pytest", "cd x && pytest tests",
                    "python3 -X dev -m unittest discover -s tests", "python3 -B -m unittest -v"):
        framework = "pytest" if "pytest" in command else "unittest"
        assert plan_canary(tasks[0].model_copy(update={"test_commands": [command],
                                                       "test_framework": framework})) is None, command
    swebench = tasks[0].model_copy(update={"test_framework": "pytest", "test_commands": [
        ". /opt/miniconda3/bin/activate && conda activate testbed && { pytest -rA tests/test_a.py; test $? -le 1; }"]})
    assert plan_canary(swebench) is None


def test_the_engine_rewards_fixes_plus_one_and_the_rest_minus_one(orchard_backend_settings, tasks):
    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            before = {s.sandbox_id for s in await client.list()}
            snapshots_before = {s.snapshot_id for s in await client.list_snapshots()}
            solver = NoisyOraclePolicy(tasks[:2], p=1.0)
            async with RolloutEngine(client, solver, EngineConfig(max_concurrent=4)) as engine:
                solved = await engine.run(tasks[:2], attempts=2)
            failer = NoisyOraclePolicy(tasks[:2], p=0.0)
            async with RolloutEngine(client, failer, EngineConfig(max_concurrent=4)) as engine:
                failed = await engine.run(tasks[:2], attempts=2)
            after = {s.sandbox_id for s in await client.list()}
            snapshots_after = {s.snapshot_id for s in await client.list_snapshots()}
            return solved, failed, after - before, snapshots_after - snapshots_before

    solved, failed, left, snapshots = asyncio.run(main())
    assert [s.reward for s in solved] == [1.0] * 4 and all(s.status == RolloutStatus.COMPLETED for s in solved)
    assert [s.reward for s in failed] == [-1.0] * 4
    assert all(s.diff for s in failed), "the wrong edit is a diff too, graded and refused"
    assert left == set() and snapshots == set(), "every sandbox and snapshot was cleaned up"


def test_submit_required_makes_a_fix_that_never_submits_earn_minus_one(orchard_backend_settings, tasks):
    """The oracle fixes at its second turn and submits at its third: cut at two turns, its fix
    is graded resolved either way, and earns +1 only where submitting is not required."""
    from orchard.rollout.loop import RolloutConfig

    async def main(required: bool):
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            config = EngineConfig(max_concurrent=2, rollout=RolloutConfig(max_turns=2, submit_required=required))
            async with RolloutEngine(client, NoisyOraclePolicy(tasks[:1], p=1.0), config) as engine:
                return await engine.run(tasks[:1], attempts=2)

    for required, reward in ((False, 1.0), (True, -1.0)):
        samples = asyncio.run(main(required))
        assert all(s.status == RolloutStatus.TRUNCATED and s.resolved for s in samples)
        assert [s.reward for s in samples] == [reward, reward]


def test_a_task_whose_setup_fails_aborts_its_rollouts(orchard_backend_settings, tasks):
    broken = tasks[2].model_copy(update={"setup": ["exit 7"], "task_id": "broken-setup"})

    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            async with RolloutEngine(client, NoisyOraclePolicy([broken], 1.0)) as engine:
                sample = await engine.rollout(broken)
            with pytest.raises(TaskSetupFailed, match="exit 7"):
                async with PreparedTask(client, broken):
                    pass
            return sample

    sample = asyncio.run(main())
    assert sample.status == RolloutStatus.ABORTED and sample.reward is None and "setup" in sample.error


def test_the_same_change_is_graded_once_per_task(orchard_backend_settings, tasks):
    task = tasks[3]

    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            async with PreparedTask(client, task) as prepared:
                made = []
                original = prepared.sandbox

                async def counted(**spec):
                    made.append(1)
                    return await original(**spec)

                prepared.sandbox = counted
                both = await asyncio.gather(grade(prepared, task.reference_patch), grade(prepared, task.reference_patch))
                again = await grade(prepared, task.reference_patch)
                other = await grade(prepared, "")
                return both, again, other, len(made)

    both, again, other, made = asyncio.run(main())
    assert all(g.resolved for g in [*both, again]) and not other.resolved
    assert [g.cached for g in both] == [False, True] and again.cached and again.seconds == 0.0
    assert made == 2, "one grading sandbox per distinct change, even for concurrent requests"


NEUTERING = ("import unittest as _u\nfor _n in [n for n in dir(_u.TestCase) if n.startswith('assert')]:\n"
             "    setattr(_u.TestCase, _n, lambda *a, **k: None)\n")


@pytest.mark.parametrize("framework", ["unittest", "pytest"])
@pytest.mark.parametrize("tampered", [False, True])
def test_the_canary_with_real_runners(tmp_path, framework, tampered):
    """Planted as grading plants it, run by the real runner: an honest run is resolved (the
    canary's failures are not held against it), one whose assertions are neutered is not."""
    files = {"pkg/__init__.py": NEUTERING if tampered else "", "pkg/core.py": "def f():\n    return 1\n",
             "tests/__init__.py": "",
             "tests/test_core.py": "import unittest\n\nfrom pkg.core import f\n\n\nclass T(unittest.TestCase):\n"
                                   "    def test_f(self):\n        self.assertEqual(f(), 1)\n\n"
                                   "    def test_g(self):\n        self.assertEqual(f() + 1, 2)\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    if framework == "unittest":
        command, ids = f"{sys.executable} -m unittest discover -v -s tests -t .", ["tests.test_core.T.test_f"]
    else:
        command = f"{sys.executable} -m pytest -rA --tb=no -p no:cacheprovider tests"
        ids = ["tests/test_core.py::T::test_f"]
    task = Task(task_id="canary", image="host", problem_statement="p", test_commands=[command],
                test_framework=framework, fail_to_pass=ids)
    canary = plan_canary(task)
    assert canary is not None
    (tmp_path / canary.path).write_text(canary.source)
    run = subprocess.run(canary.commands[0], shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    resolved, details = tests_passed(task, [run.stdout + run.stderr], [run.returncode], canaries=canary.names)
    assert resolved is not tampered, details["reason"]
    assert ("tampered with" in details["reason"]) is tampered
    assert sorted(details["results"]) == sorted(ids + [ids[0].replace("test_f", "test_g")]), "no canary among them"
