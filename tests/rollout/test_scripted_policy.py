"""ScriptedPolicy: turns from a list or a function, and fake tokens with exact masks."""

from __future__ import annotations

import asyncio

import pytest

from orchard.rollout.policies import SUBMIT, ScriptedPolicy, bash_block, build_policy
from orchard.rollout.policies.scripted import END_OF_TURN, decode

TASK = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "fix parser.py"}]


def run(coroutine):
    return asyncio.run(coroutine)


async def episode(policy, observations, max_tokens=64):
    context = await policy.begin(TASK)
    generations = []
    for observation in observations:
        generations.append(await policy.act(context, max_tokens))
        await policy.observe(context, observation)
    generations.append(await policy.act(context, max_tokens))
    return context, generations


def test_bash_block_is_the_action_format_the_loop_parses():
    assert bash_block("ls -la") == "```bash\nls -la\n```"
    assert SUBMIT == "```bash\nsubmit\n```"


def test_a_list_of_turns_is_played_in_order_then_the_policy_submits():
    policy = ScriptedPolicy.commands(["ls", "cat parser.py"])
    context, generations = run(episode(policy, ["a.py parser.py", "def parse(): ..."]))
    assert [g.text for g in generations] == [bash_block("ls"), bash_block("cat parser.py"), SUBMIT]
    assert [m["role"] for m in context.messages] == ["system", "user", "assistant", "user", "assistant", "user",
                                                     "assistant"]
    assert context.messages[3]["content"] == "a.py parser.py"
    assert not context.tokenized and all(not g.token_ids for g in generations)
    assert TASK[1] == {"role": "user", "content": "fix parser.py"}  # the task's messages are copied, not extended


def test_a_script_function_sees_the_conversation_and_the_turn_index():
    seen = []

    def script(messages, turn):
        seen.append((turn, messages[-1]["content"]))
        return bash_block(f"echo {turn}") if turn < 2 else SUBMIT

    _, generations = run(episode(ScriptedPolicy(script), ["out0", "out1"]))
    assert seen == [(0, "fix parser.py"), (1, "out0"), (2, "out1")]
    assert generations[-1].text == SUBMIT


def test_concurrent_rollouts_keep_their_own_turns():
    policy = ScriptedPolicy.commands(["first", "second"])

    async def two():
        a, b = await policy.begin(TASK), await policy.begin(TASK)
        first_a = await policy.act(a, 64)
        first_b = await policy.act(b, 64)
        await policy.observe(a, "x")
        second_a = await policy.act(a, 64)
        return first_a.text, first_b.text, second_a.text

    assert run(two()) == (bash_block("first"), bash_block("first"), bash_block("second"))


def test_tokenized_turns_have_exact_masks_and_logprobs():
    policy = ScriptedPolicy.commands(["ls"], tokenized=True, logprob=-0.25)
    context, generations = run(episode(policy, ["a.py"]))
    assert len(context.tokens) == len(context.logprobs) == len(context.loss_mask)
    trained = [t for t, m in zip(context.tokens, context.loss_mask) if m]
    assert trained == generations[0].token_ids + generations[1].token_ids
    assert generations[0].token_ids == list(bash_block("ls").encode()) + [END_OF_TURN]
    assert all(lp == -0.25 for lp, m in zip(context.logprobs, context.loss_mask) if m)
    assert all(lp == 0.0 for lp, m in zip(context.logprobs, context.loss_mask) if not m)
    assert context.generated_tokens == sum(len(g.token_ids) for g in generations)
    prompt = decode(context.tokens[:context.prompt_length])
    assert prompt == "<|system|>You fix bugs.<|end|>\n<|user|>fix parser.py<|end|>\n<|assistant|>"
    assert decode(context.tokens) == prompt + bash_block("ls") + "<|end|>\n<|user|>a.py<|end|>\n<|assistant|>" + \
        SUBMIT + "<|end|>\n"


def test_tokenized_turn_is_cut_at_max_tokens():
    policy = ScriptedPolicy.commands(["pytest -q tests/test_parser.py"], tokenized=True)
    context = run(policy.begin(TASK))
    generation = run(policy.act(context, 5))
    assert generation.finish_reason == "length"
    assert generation.token_ids == list(b"```ba") and generation.text == "```ba"
    assert context.generated_tokens == 5
    assert context.tokens[-2:] == [END_OF_TURN, ord("\n")] and context.loss_mask[-2:] == [0, 0]
    assert context.messages[-1] == {"role": "assistant", "content": "```ba"}


def test_a_turn_that_fits_exactly_without_its_end_token_is_cut():
    text = bash_block("ls")
    policy = ScriptedPolicy([text], tokenized=True)
    generation = run(policy.act(run(policy.begin(TASK)), len(text)))
    assert generation.finish_reason == "length" and END_OF_TURN not in generation.token_ids


def test_bad_scripts_are_refused():
    with pytest.raises(TypeError, match="not one string"):
        ScriptedPolicy("ls")
    policy = ScriptedPolicy(lambda messages, turn: None)
    with pytest.raises(TypeError, match="NoneType for turn 0"):
        run(policy.act(run(policy.begin(TASK)), 10))


def test_build_policy_by_kind():
    policy = build_policy("scripted", commands=["ls"], tokenized=True)
    assert isinstance(policy, ScriptedPolicy) and policy.tokenized
    assert run(policy.act(run(policy.begin(TASK)), 64)).text == bash_block("ls")
    assert isinstance(build_policy("scripted", turns=["hi"]), ScriptedPolicy)
    with pytest.raises(ValueError, match=r"unknown policy kind 'vllm'.*'huggingface', 'openai', 'scripted'"):
        build_policy("vllm")
    with pytest.raises(ValueError, match="needs 'path'"):
        build_policy("huggingface")
