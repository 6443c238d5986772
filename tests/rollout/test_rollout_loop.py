"""The multi-turn loop against real sandboxes: actions, observations, limits, tokens, loss."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path


from orchard.client.aio import AsyncClient
from orchard.rollout.actions import bash_block, parse_action
from orchard.rollout.engine import EngineConfig, RolloutEngine
from orchard.rollout.loop import RolloutConfig, cut, run_episode
from orchard.rollout.policies.scripted import END_OF_TURN, ScriptedPolicy
from orchard.rollout.sample import RolloutStatus
from orchard.tasks import Task


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
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().split(b"\0")[0] == b"/dev/.orchard-hold" \
                    and (entry / "root/tmp" / marker).exists():
                return int(entry.name)
        except OSError:
            continue
    raise AssertionError("no holder found")


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
            await asyncio.sleep(0.5)  # a sandbox still being made when cut off is deleted once made
            return samples, {s.sandbox_id for s in await client.list()} - before

    samples, left = asyncio.run(main())
    assert [s.status for s in samples] == [RolloutStatus.TIMED_OUT] * 2
    assert left == set()
