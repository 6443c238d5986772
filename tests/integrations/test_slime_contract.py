"""Contract tests of orchard.integrations.slime against DOUBLES (slime and SGLang are not here).

slime's ``Sample`` is a stand-in, SGLang a loopback double backed by a tiny Llama, both in
``slime_doubles.py``; the sandboxes, the rollout engine, grading and BAR are Orchard's own,
on the local backend. What slime itself, Megatron and a GPU would do was never run here.
"""

from __future__ import annotations

import asyncio
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from orchard.integrations.slime import (
    GenerationAborted, SGLangPolicy, SlimeNotInstalled, SlimeSettings, configure, fill_group, generate_rollout,
    generate_sft_rollout, grade_reward, prompt_rows, reward_post_process, sample_class, set_sample_class, shutdown,
)
from orchard.pipeline.choice import choice_suite
from orchard.pipeline.expert import apply_command
from orchard.rollout.actions import bash_block
from orchard.rollout.sample import RolloutSample, RolloutStatus
from orchard.tasks.generated import generate_suite
from orchard.train.bar import BARConfig, Band, bar_sample
from orchard.train.credit import Step, Trajectory, sft_example
from orchard.train.rl_trainer import RLTrainer
from orchard.train.sft_data import tokenize_example
from tests.integrations.slime_doubles import (
    ABORT, HOLD, DataSource, SGLangDouble, StandInSample, model_logprobs, slime_args, slime_default_rewards,
    slime_train_data,
)
from tests.rollout.tiny_lm import make_tokenizer

SUBMIT = bash_block("submit")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def test_importing_needs_no_slime_and_a_sample_without_it_says_what_to_install():
    assert not any(name == "slime" or name.startswith("slime.") for name in sys.modules)
    set_sample_class(None)
    with pytest.raises(SlimeNotInstalled, match=r"git\+https://github.com/THUDM/slime.*unrelated PyPI"):
        sample_class()
    assert sample_class(StandInSample) is StandInSample


def test_the_sglang_policy_speaks_generate_token_ids_logprobs_finish_reasons_and_abort(tokenizer):
    replies = iter(["```bash\nls\n```", "x" * 200, ABORT, HOLD])
    double = SGLangDouble(lambda text, body: next(replies), tokenizer)
    policy = SGLangPolicy(double.url, tokenizer, retries=0)

    async def main():
        context = await policy.begin([{"role": "user", "content": "fix it"}])
        prompt = list(context.tokens)
        first = await policy.act(context, 32)
        await policy.observe(context, "exit code: 0")
        before = list(context.tokens)
        second = await policy.act(context, 8)
        with pytest.raises(GenerationAborted):
            await policy.act(context, 8)
        held = asyncio.ensure_future(policy.act(context, 8))
        while not double.held:
            await asyncio.sleep(0.01)
        await policy.abort()
        with pytest.raises(GenerationAborted):
            await held
        await policy.close()
        return context, prompt, before, first, second

    try:
        context, prompt, before, first, second = asyncio.run(main())
    finally:
        double.close()
    body = double.requests[0]
    assert body["input_ids"] == prompt and body["return_logprob"] is True
    assert body["sampling_params"]["max_new_tokens"] == 32
    assert tokenizer.eos_token_id in body["sampling_params"]["stop_token_ids"]
    assert double.requests[1]["input_ids"] == before, "the whole recorded sequence goes back, nothing re-tokenized"
    assert first.text == "```bash\nls\n```" and first.finish_reason == "stop"
    assert second.finish_reason == "length" and len(second.token_ids) == 8
    assert double.aborts == [{"abort_all": True}]
    # each sampled token sits in the context with mask 1 and the model's own log-prob; the rest is mask 0
    sampled = [i for i, m in enumerate(context.loss_mask) if m]
    assert [context.tokens[i] for i in sampled] == first.token_ids + second.token_ids
    fresh = model_logprobs(double.model, context.tokens, 1)
    assert [context.logprobs[i] for i in sampled] == pytest.approx([fresh[i - 1] for i in sampled], abs=1e-4)
    assert "exit code: 0" in tokenizer.decode([t for t, m in zip(context.tokens, context.loss_mask) if not m])


class Script:
    """What the double samples: per task, the first turns' plans in arrival order; then submit."""

    def __init__(self, tasks, plans):
        self.tasks, self.plans = tasks, {task.task_id: list(plan) for task, plan in zip(tasks, plans)}

    def __call__(self, text, body):
        if "exit code" in text:
            return SUBMIT
        task = next(t for t in self.tasks if t.problem_statement.strip()[:80] in text)
        plan = self.plans[task.task_id].pop(0)
        choice = task.metadata["choice"]
        wrong = next(n for n in choice["candidates"] if n != choice["fix"])
        if plan == "fix":
            return bash_block(apply_command(choice["fix"]))
        if plan == "wrong":
            return bash_block(apply_command(wrong))
        if plan == "tamper":  # the tests, emptied in the rollout's own sandbox
            return bash_block("for f in tests/test_*.py; do printf 'import unittest\\n' > \"$f\"; done")
        return plan


@pytest.fixture(scope="module")
def tasks(kit_image):
    return choice_suite(generate_suite(6, seed=4, image=kit_image), size=6, seed=4)[:2]


@pytest.fixture(scope="module")
def sandboxes(orchard_backend_settings, tokenizer):
    """A runtime on the local backend; each test points it at its own SGLang double."""
    made = []

    def make(respond, **settings):
        double = SGLangDouble(respond, tokenizer)
        made.append(double)
        values = dict(backend="local", backend_settings=orchard_backend_settings["local"], router_url=double.url,
                      max_concurrent=4, max_rollouts=4, stride=4, adaptive_band=False,
                      rollout={"max_turns": 3, "system_prompt": "Answer with one bash block."})
        values.update(settings)
        return configure(SlimeSettings(**values), slime_args(), tokenizer=tokenizer,
                         sample_class=StandInSample), double

    yield make
    shutdown()
    for double in made:
        double.close()


def standalone_advantages(rewards):
    """GRPO's (r - mean) / (std + 1e-4) over the valid rewards, std with n - 1, by hand."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1))
    return [(r - mean) / (std + 1e-4) for r in rewards]


def test_generate_rollout_fills_every_field_slime_checks_with_uneven_bar_groups(sandboxes, tasks):
    script = Script(tasks, [["fix", "fix", "wrong", "wrong"], ["fix", "wrong", "wrong", ABORT]])
    rt, double = sandboxes(script)
    args = slime_args()
    source = DataSource(prompt_rows(tasks), args.n_samples_per_prompt)
    groups = generate_rollout(args, 0, source)

    assert [len(g) for g in groups] == [4, 4]
    assert [[s.group_index for s in g] for g in groups] == [[0] * 4, [1] * 4]
    assert [s.index for g in groups for s in g] == list(range(8))
    for task, group in zip(tasks, groups):
        prompt = rt.prompt_tokens(task)
        for sample in group:
            sample.validate()
            n = sample.response_length
            assert sample.tokens[:len(sample.tokens) - n] == prompt, "tokens are the prompt, then the response"
            assert len(sample.loss_mask) == len(sample.rollout_log_probs) == n
            info = sample.metadata["orchard"]
            if not info["valid"]:
                assert sample.remove_sample and sample.reward == 0.0 and not any(sample.loss_mask)
                assert sample.status == StandInSample.Status.ABORTED and info["error_type"] == "policy_error", info.get("error")
                continue
            assert sample.status == StandInSample.Status.COMPLETED and not sample.remove_sample
            assert sample.reward == (1.0 if info["resolved"] else -1.0)
            response = sample.tokens[-n:]
            trained = [i for i, m in enumerate(sample.loss_mask) if m]
            assert trained and sample.loss_mask[0] == 1, "the response starts with the first sampled token"
            fresh = model_logprobs(double.model, sample.tokens, len(sample.tokens) - n)
            assert [sample.rollout_log_probs[i] for i in trained] == pytest.approx([fresh[i] for i in trained],
                                                                                   abs=1e-4)
            assert all(sample.rollout_log_probs[i] == 0.0 for i in range(n) if not sample.loss_mask[i])
            observation = rt.tokenizer.decode([t for t, m in zip(response, sample.loss_mask) if not m])
            assert "exit code: 0" in observation, "the observation is in the response, masked"
            assert "submit" in rt.tokenizer.decode([t for t, m in zip(response, sample.loss_mask) if m])
    assert sorted(s.reward for s in groups[0]) == [-1.0, -1.0, 1.0, 1.0]
    assert sorted(s.reward for s in groups[1] if not s.remove_sample) == [-1.0, -1.0, 1.0]
    assert groups[1][0].metadata["orchard"]["fallback"] == "ordering"

    flat = [s for g in groups for s in g]
    raw, advantages = reward_post_process(args, flat)
    slime_train_data(flat, advantages)
    for group in groups:
        valid = [s for s in group if not s.remove_sample]
        expected = standalone_advantages([s.reward for s in valid])
        assert [advantages[flat.index(s)] for s in valid] == pytest.approx(expected, abs=1e-6)
        assert all(advantages[flat.index(s)] == 0.0 for s in group if s.remove_sample)
    default = slime_default_rewards(flat, 4)
    assert default[4:] != pytest.approx(advantages[4:], abs=1e-3), "slime's fixed rows would count the empty slot"

    with pytest.raises(ValueError, match="custom-reward-post-process-path"):
        generate_rollout(slime_args(custom_reward_post_process_path=None), 1, source)


def fake_rollout(attempt: int, status: RolloutStatus, reward):
    return RolloutSample("t", attempt, status, reward=reward, tokens=[5, 6, 7, 8, 9, 10],
                         logprobs=[0.0, 0.0, 0.0, -0.1, 0.0, -0.3], loss_mask=[0, 0, 0, 1, 0, 1], prompt_length=3)


@pytest.mark.parametrize("scale", [True, False], ids=["grpo", "dr_grpo"])
def test_uneven_bar_groups_get_the_standalone_trainers_advantages(scale):
    C, T, TO, A = RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED, RolloutStatus.TIMED_OUT, RolloutStatus.ABORTED
    pools = [
        [(C, 1), (C, -1), (C, 1), (T, -1), (C, 1), (C, 1), (C, 1), (C, 1)],  # balanced in the first stride
        [(A, None), (C, 1), (TO, None), (C, -1), (C, -1), (A, None), (C, 1), (A, None)],  # balanced late
        [(A, None)] * 6 + [(C, 1), (C, -1)],  # budget spent: the fallback ordering, two valid of four
        [(C, -1)] * 8,  # relaxed: all failures, zero advantages
    ]
    config = BARConfig(group_size=4, max_rollouts=8, stride=4, band=Band(0.25, 0.75))

    async def select(pool):
        queue = [fake_rollout(i, s, r).to_bar() for i, (s, r) in enumerate(pool)]

        async def generate(k):
            return [queue.pop(0) for _ in range(k)]
        return await bar_sample(generate, config)

    selections = [asyncio.run(select(pool)) for pool in pools]
    short = selections[0].__class__(selections[0].group[:2], 2, 1, None, Band(0.25, 0.75))  # fewer rollouts than G
    selections.append(short)
    assert [s.fallback for s in selections] == [None, None, "ordering", "relaxed", None]
    trainer = SimpleNamespace(config=SimpleNamespace(group_size=4, scale_advantages=scale))
    standalone_samples, standalone = RLTrainer._training_samples(trainer, selections)

    groups = [[StandInSample(group_index=row, index=row * 4 + slot) for slot in range(4)] for row in
              range(len(selections))]
    for group, selection in zip(groups, selections):
        fill_group(group, selection, [5, 6, 7], pad_id=0)
    flat = [s for g in groups for s in g]
    raw, ours = reward_post_process(slime_args(grpo_std_normalization=scale), flat)
    slime_train_data(flat, ours)
    kept = [i for i, s in enumerate(flat) if not s.remove_sample]
    assert [ours[i] for i in kept] == standalone, "the same numbers, not merely close"
    assert [flat[i].reward for i in kept] == [s.reward for s in standalone_samples]
    assert all(ours[i] == 0.0 and not any(flat[i].loss_mask) for i in range(len(flat)) if i not in kept)
    assert len(flat) == 4 * len(selections), "slime's batch keeps G samples per prompt"
    assert flat[-1].tokens == [5, 6, 7, 0] and flat[-1].response_length == 1, "an empty slot: prompt and one pad"


def test_the_reward_function_grades_in_a_fresh_fork_so_tampering_with_the_tests_earns_minus_one(sandboxes, tasks):
    from orchard.integrations.slime import generate

    task = tasks[0]
    rt, _ = sandboxes(Script([task], [["tamper", "fix"]]))
    args = slime_args()
    row = prompt_rows([task])[0]

    async def rollout_then_reward():
        results = []
        for _ in range(2):
            sample = StandInSample(prompt=row["prompt"], metadata=dict(row["metadata"]), group_index=0, index=0)
            sample = await generate(args, sample, {"max_new_tokens": 64})
            assert sample.reward is None, "left to slime's reward function"
            results.append((sample, await grade_reward(args, sample)))
        return results

    (tampered, bad), (fixed, good) = asyncio.run(rollout_then_reward())
    assert bad == -1.0 and good == 1.0
    assert any(path.startswith("tests/") for path in tampered.metadata["orchard"]["grade"]["dropped_paths"])
    assert "tests/" in tampered.metadata["orchard"]["diff"], "the rollout did empty the tests in its own sandbox"
    assert asyncio.run(grade_reward(args, [tampered, fixed])) == [-1.0, 1.0], "--group-rm: one reward each"


def test_sft_rollout_trains_only_the_credited_actions(tokenizer):
    trajectory = Trajectory("t1", "Fix the bug in parser.py", [Step("ls -la", "a.py"), Step("edit the file", "ok"),
                                                              Step("run the tests", "1 failed, 3 passed")], False)
    messages = sft_example(trajectory, [False, True, False], system="Use bash.").to_dict()["messages"]
    args = slime_args(rollout_batch_size=1, n_samples_per_prompt=1)
    groups = generate_sft_rollout(args, 0, DataSource([{"prompt": messages}], 1), tokenizer=tokenizer)
    sample = groups[0][0]
    expected = tokenize_example(tokenizer, messages, args.seq_length)
    start = expected.loss_mask.index(1)
    assert sample.tokens == expected.input_ids and sample.loss_mask == expected.loss_mask[start:]
    assert sample.response_length == len(sample.tokens) - start == len(sample.loss_mask)
    trained = [t for t, m in zip(sample.tokens[-sample.response_length:], sample.loss_mask) if m]
    assert tokenizer.decode(trained) == "edit the file<|end|>", "the credited action and the token ending it"
    assert sample.status == StandInSample.Status.COMPLETED and sample.reward == 0.0
    slime_train_data([sample], [0.0])
    with pytest.raises(ValueError, match="--input-key messages"):
        generate_sft_rollout(args, 0, DataSource([{"prompt": "a string"}], 1), tokenizer=tokenizer)
