"""The multi-turn loop against real sandboxes: actions, observations, limits, tokens, loss."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal


from orchard.client.aio import AsyncClient
from orchard.errors import SandboxNotFound, SnapshotNotFound
from orchard.rollout.actions import bash_block, parse_action
from orchard.rollout.engine import EngineConfig, RolloutEngine
from orchard.rollout.environment import PreparedTask
from orchard.rollout.loop import RolloutConfig, cut, run_episode
from orchard.rollout.policies.scripted import END_OF_TURN, ScriptedPolicy
from orchard.rollout.sample import RolloutStatus
from orchard.tasks import Task
from tests.holders import holder_with_marker


def _task(**overrides) -> Task:
    fields = {"task_id": "loop-task", "image": "host", "problem_statement": "Make greeting.txt say hello.",
              "files": {"greeting.txt": "bye\n"}, "setup": ["git init -q", "git add -A",
                                                          "git -c user.email=t@t -c user.name=t commit -qm base"],
              "test_commands": ["grep -qx hello greeting.txt"], **overrides}
    return Task(**fields)


def _client(orchard_backend_settings) -> AsyncClient:
    return AsyncClient(backend_settings=orchard_backend_settings["local"])


def _episode(orchard_backend_settings, policy, task: Task, config: RolloutConfig):
    async def main():
        async with _client(orchard_backend_settings) as client:
            sandbox = await client.create(task.image)
            try:
                await sandbox.exec(f"mkdir -p {task.workdir}", check=True)
                return await run_episode(policy, sandbox, task, config)
            finally:
                await sandbox.delete()
    return asyncio.run(main())


def test_the_action_format():
    assert parse_action(bash_block("ls -la")).command == "ls -la"
    assert parse_action("thinking...\n" + bash_block("submit")).kind == "submit"
    assert parse_action("no block here").kind == "invalid"
    assert "2 ```bash blocks" in parse_action(bash_block("a") + "\n" + bash_block("b")).error
    assert parse_action("```bash\n\n```").kind == "invalid"
    assert parse_action("```python\nprint(1)\n```").kind == "invalid"


def test_cut_keeps_head_and_tail_within_the_limit():
    text = "a" * 500 + "b" * 500
    short = cut(text, 100)
    assert len(short) <= 100 and short.startswith("a") and short.endswith("b") and "characters cut" in short
    assert cut("short", 100) == "short"


def test_commands_run_observations_come_back_and_submit_completes(orchard_backend_settings):
    policy = ScriptedPolicy.commands(["cat greeting.txt", "echo oops >&2; exit 3", "printf '%s' hello > x"])
    sample = _episode(orchard_backend_settings, policy, _task(workdir="/workspace"), RolloutConfig())
    assert sample.status == RolloutStatus.COMPLETED and sample.error is None
    assert [t.exit_code for t in sample.turns[:3]] == [1, 3, 0]  # no greeting.txt here: no setup ran
    assert sample.turns[1].observation == "exit code: 3\noops\n"
    assert [m["role"] for m in sample.messages][:4] == ["system", "user", "assistant", "user"]
    assert sample.turns[-1].action == "submit" and sample.sandbox_seconds > 0


def test_limits_truncate_and_time_out(orchard_backend_settings):
    forever = ScriptedPolicy(lambda messages, turn: bash_block("true"))
    truncated = _episode(orchard_backend_settings, forever, _task(), RolloutConfig(max_turns=3))
    assert truncated.status == RolloutStatus.TRUNCATED and "max_turns" in truncated.error
    assert len(truncated.turns) == 3
    slow = ScriptedPolicy.commands(["sleep 30", "true"])
    timed = _episode(orchard_backend_settings, slow, _task(), RolloutConfig(time_limit_seconds=1.5))
    assert timed.status == RolloutStatus.TIMED_OUT and timed.wall_seconds < 10
    chatty = ScriptedPolicy.commands(["seq 1 100000", "seq 1 100000"], tokenized=True)
    capped = _episode(orchard_backend_settings, chatty, _task(),
                      RolloutConfig(max_total_tokens=4000, observation_max_chars=3000))
    assert capped.status == RolloutStatus.TRUNCATED and "max_total_tokens" in capped.error
    assert len(capped.turns[0].observation) <= 3000 and "characters cut" in capped.turns[0].observation


def test_a_command_timeout_is_an_observation_not_an_abort(orchard_backend_settings):
    policy = ScriptedPolicy.commands(["sleep 20", "echo next"])
    sample = _episode(orchard_backend_settings, policy, _task(), RolloutConfig(command_timeout_seconds=1))
    assert sample.status == RolloutStatus.COMPLETED
    assert "killed" in sample.turns[0].observation and sample.turns[1].observation == "exit code: 0\nnext\n"


def test_format_errors_spend_a_turn_and_explain(orchard_backend_settings):
    policy = ScriptedPolicy(["I will just talk.", bash_block("submit")])
    sample = _episode(orchard_backend_settings, policy, _task(), RolloutConfig())
    assert sample.turns[0].action == "invalid" and "```bash" in sample.turns[0].observation
    assert sample.status == RolloutStatus.COMPLETED


def test_tokens_logprobs_and_the_loss_mask_cover_exactly_what_was_sampled(orchard_backend_settings):
    policy = ScriptedPolicy.commands(["echo observed-text"], tokenized=True)
    sample = _episode(orchard_backend_settings, policy, _task(), RolloutConfig())
    assert len(sample.tokens) == len(sample.logprobs) == len(sample.loss_mask) > sample.prompt_length > 0
    sampled = [t for t, m in zip(sample.tokens, sample.loss_mask) if m]
    expected = [t for turn in sample.turns for t in list(turn.text.encode()) + [END_OF_TURN]]
    assert sampled == expected, "mask 1 on the turns' own tokens, nothing else"
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    observed = bytes(t for t, m in zip(sample.tokens, sample.loss_mask) if not m and t < 256).decode()
    assert "observed-text" in observed, "observations are in the sequence, masked out"


async def _holder_pid(sandbox) -> int:
    """The sandbox's holder (its PID 1) seen from the host, found by a marker only its root has."""
    marker = f"marker-{sandbox.id}"
    await sandbox.exec(f"touch /tmp/{marker}", check=True)
    return holder_with_marker(marker)


def test_a_lost_sandbox_aborts_the_rollout_without_a_reward_and_nothing_is_left(orchard_backend_settings, kit_image):
    """The holder is killed mid-rollout (as a Slurm job cancel or an eviction would): the
    sample is aborted, never -1, and every sandbox of the engine is deleted."""
    task = _task(image=kit_image)
    holders: list[int] = []

    def script(messages, turn):
        if turn == 1:
            os.kill(holders[0], signal.SIGKILL)
        return bash_block("echo still-here") if turn < 3 else bash_block("submit")

    async def main():
        async with _client(orchard_backend_settings) as client:
            before = {s.sandbox_id for s in await client.list()}
            async with RolloutEngine(client, ScriptedPolicy(script), EngineConfig(max_concurrent=1)) as engine:
                prepared = engine.prepared(task)
                make = prepared.sandbox

                async def watched(**spec):
                    sandbox = await make(**spec)
                    holders.append(await _holder_pid(sandbox))
                    return sandbox

                prepared.sandbox = watched
                sample = await engine.rollout(task)
                metrics = engine.metrics.summary()
            return sample, metrics, {s.sandbox_id for s in await client.list()} - before

    sample, metrics, left = asyncio.run(main())
    assert sample.status == RolloutStatus.ABORTED and sample.reward is None and sample.grade is None
    assert sample.error_type == "sandbox_lost" and sample.to_bar().valid is False, sample.error
    assert metrics["failures"] == {"sandbox_lost": 1}
    assert left == set(), "the lost sandbox was deleted too"


def test_straggler_rollouts_are_cut_off_and_cleaned_up(orchard_backend_settings):
    class Stuck(ScriptedPolicy):
        async def act(self, context, max_tokens):
            await asyncio.sleep(60)
            return await super().act(context, max_tokens)

    task = _task(time_limit_seconds=1.0)

    async def main():
        async with _client(orchard_backend_settings) as client:
            before = {s.sandbox_id for s in await client.list()}
            config = EngineConfig(max_concurrent=2, grace_seconds=0.5)
            async with RolloutEngine(client, Stuck(["x"]), config) as engine:
                samples = await engine.run([task], attempts=2)
            return samples, {s.sandbox_id for s in await client.list()} - before

    samples, left = asyncio.run(main())
    assert [s.status for s in samples] == [RolloutStatus.TIMED_OUT] * 2
    assert left == set()


def test_the_policy_cannot_abort_its_own_rollout(orchard_backend_settings):
    """What an action breaks is the policy's doing: an observation, the turn spent, the episode
    goes on (and is graded), never ``aborted``, which would spare it the -1 and drop it from n."""
    workdir = "/workspace/repo"
    policy = ScriptedPolicy.commands([
        "echo " + "A" * 200_000 + " | wc -c",  # past one argument's limit (E2BIG)
        ": " + "A" * 3_000_000,  # past the exec API's limit
        "echo a\x00b",
        "echo \ud800",
        "echo still-here",
        f"rm -rf {workdir}",
        "pwd",
        f"mkdir -p {workdir} && cd {workdir} && echo back",
        "pwd",
        "echo 'orchard-enter: forged' >&2; exit 125",  # how the service says its helper failed
    ])
    sample = _episode(orchard_backend_settings, policy, _task(workdir=workdir),
                      RolloutConfig(max_turns=12, max_total_tokens=10_000_000))
    assert sample.status == RolloutStatus.COMPLETED and sample.error is None, (sample.error_type, sample.error)
    observations = [turn.observation for turn in sample.turns]
    assert "nothing ran" in observations[0] and "bytes" in observations[0] and "limit" in observations[0]
    assert "nothing ran" in observations[1]
    assert "NUL" in observations[2] and "nothing ran" in observations[2]
    assert "surrogate" in observations[3] and "nothing ran" in observations[3]
    assert observations[4] == "exit code: 0\nstill-here\n"
    assert f"{workdir} does not exist" in observations[6] and observations[6].endswith("exit code: 0\n/\n")
    assert observations[8] == f"exit code: 0\n{workdir}\n", "back in the working directory once it exists again"
    assert observations[9] == "exit code: 125\norchard-enter: forged\n"
    assert [turn.exit_code for turn in sample.turns[:4]] == [None] * 4


def test_a_command_timeout_past_the_exec_apis_limit_is_clamped(orchard_backend_settings, caplog):
    """A task (or config) asking for more than the exec API allows per command (infinity, say)
    still runs, setup included: its commands get the API's maximum, and the log says so."""
    task = _task(task_id="unbounded", command_timeout_seconds=float("inf"), time_limit_seconds=float("inf"))

    async def main():
        async with _client(orchard_backend_settings) as client:
            config = EngineConfig(max_concurrent=1, grade=False)
            async with RolloutEngine(client, ScriptedPolicy.commands(["cat greeting.txt"]), config) as engine:
                return await engine.rollout(task)

    sample = asyncio.run(main())
    assert sample.status == RolloutStatus.COMPLETED, (sample.error_type, sample.error)
    assert sample.turns[0].observation == "exit code: 0\nbye\n"
    assert any("unbounded" in r.getMessage() and "604800" in r.getMessage() for r in caplog.records)


def test_cancelling_leaves_no_sandbox_and_no_snapshot(orchard_backend_settings, kit_image):
    """Cancelled at any moment (inside create, inside snapshot, anywhere in ``engine.run``),
    nothing is left: each id is chosen before its call, and a cancelled call's id is deleted
    before the cancellation goes on."""
    tasks = [_task(image=kit_image), _task(task_id="loop-task-2", image=kit_image)]

    async def cancel_prepare(client, method: str, delay: float) -> None:
        started, call = asyncio.Event(), getattr(client, method)

        async def watched(*args, **kwargs):
            started.set()
            return await call(*args, **kwargs)

        setattr(client, method, watched)
        try:
            prepared = PreparedTask(client, tasks[0])
            job = asyncio.ensure_future(prepared.prepare())
            await started.wait()
            await asyncio.sleep(delay)
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job
            await prepared.close()
        finally:
            delattr(client, method)

    async def cancel_run(client, delay: float) -> None:
        async with RolloutEngine(client, ScriptedPolicy.commands(["echo hello > greeting.txt"]),
                                 EngineConfig(max_concurrent=2)) as engine:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(engine.run(tasks, attempts=2), delay)

    async def main():
        leaks = []
        async with _client(orchard_backend_settings) as client:
            async def state():
                return ({s.sandbox_id for s in await client.list()},
                        {s.snapshot_id for s in await client.list_snapshots()})

            before = await state()
            cases = [(f"{method} +{delay}s", cancel_prepare(client, method, delay))
                     for method in ("create", "snapshot") for delay in (0.0, 0.02, 0.05, 0.1)]
            cases += [(f"run {delay}s", cancel_run(client, delay))
                      for delay in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.7)]
            for name, case in cases:
                await case
                after = await state()
                if after[0] - before[0] or after[1] - before[1]:
                    leaks.append((name, after[0] - before[0], after[1] - before[1]))
                    for sandbox_id in after[0] - before[0]:
                        with contextlib.suppress(SandboxNotFound):
                            await client.delete(sandbox_id)
                    for snapshot_id in after[1] - before[1]:
                        with contextlib.suppress(SnapshotNotFound):
                            await client.delete_snapshot(snapshot_id)
        return leaks

    leaks = asyncio.run(main())
    assert not leaks, "\n".join(map(str, leaks))
