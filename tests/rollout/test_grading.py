"""Grading a model cannot tamper with: whatever the rollout sandbox holds, only the diff of
non-protected source files reaches a fresh fork of the task's starting state."""

from __future__ import annotations

import asyncio

import pytest

from orchard.client.aio import AsyncClient
from orchard.rollout.engine import EngineConfig, RolloutEngine
from orchard.rollout.environment import PreparedTask, TaskSetupFailed
from orchard.rollout.grading import extract_diff, grade
from orchard.rollout.policies.oracle import NoisyOraclePolicy
from orchard.rollout.sample import RolloutStatus
from orchard.tasks.generated import generate_suite

def fake_runner(task) -> str:
    """A stand-in for unittest that reports every listed test as passed, as the real one would."""
    lines = []
    for test_id in task.fail_to_pass + task.pass_to_pass:
        name = test_id.rsplit(".", 1)[1]
        lines.append(f"{name} ({test_id}) ... ok")
    report = "\n".join(lines) + f"\n\n{'-' * 70}\nRan {len(lines)} tests in 0.001s\n\nOK\n"
    return f"import sys\nsys.stderr.write({report!r})\nraise SystemExit(0)\n"


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
                        await sandbox.exec(command.format(fake_runner=fake_runner(task)), cwd=task.workdir)
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
    assert any(p.startswith("tests/") for p in grades["neuter the assertions"].dropped_paths)
    assert "unittest.py" in grades["a module shadowing unittest"].dropped_paths
    assert {"conftest.py", "pytest.ini"} <= set(grades["a conftest and a pytest.ini"].dropped_paths)


def test_a_real_fix_is_resolved_whatever_tampering_comes_with_it(orchard_backend_settings, tasks):
    task = tasks[1]
    kept = {name: TAMPERING[name] for name in ("nothing", "delete the tests", "neuter the assertions",
                                                "a fake python3 on PATH", "a module shadowing unittest")}
    grades = _grades(orchard_backend_settings, task, kept, fix=True)
    for name, result in grades.items():
        assert result.resolved, f"the reference fix with {name!r} was not resolved: {result.detail}"
        assert all(status == "PASSED" for test, status in result.tests.items() if test in task.fail_to_pass)


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
