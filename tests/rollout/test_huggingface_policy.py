"""HuggingFacePolicy on a tiny random Llama and a tokenizer built here (nothing downloaded).

The property the RL trainer depends on: the recorded log-prob of every sampled token equals
the log-prob a fresh forward pass over the final token sequence gives it, at temperature 1.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from orchard.rollout.policies import build_policy  # noqa: E402
from orchard.rollout.policies.chat_template import ChatTemplateTokens  # noqa: E402
from orchard.rollout.policies.huggingface import HuggingFacePolicy  # noqa: E402
from tests.rollout.tiny_lm import fresh_logprobs, make_tokenizer, tiny_model  # noqa: E402

TASK = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "fix the bug in parser.py"}]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def run(coroutine):
    return asyncio.run(coroutine)


async def episode(policy, observations, max_tokens=12, task=TASK):
    context = await policy.begin(task)
    generations = [await policy.act(context, max_tokens)]
    for observation in observations:
        await policy.observe(context, observation)
        generations.append(await policy.act(context, max_tokens))
    return context, generations


def assert_logprobs_match_a_fresh_forward(model, context):
    assert len(context.tokens) == len(context.logprobs) == len(context.loss_mask)
    fresh = [0.0] + fresh_logprobs(model, context.tokens)
    trained = [i for i, m in enumerate(context.loss_mask) if m]
    assert trained, "nothing was sampled"
    assert trained[0] >= context.prompt_length
    for i in trained:
        assert context.logprobs[i] == pytest.approx(fresh[i], abs=1e-4), f"token {i}"
    assert all(context.logprobs[i] == 0.0 for i, m in enumerate(context.loss_mask) if not m)


def test_an_episode_records_the_sampled_tokens_and_their_exact_logprobs(tokenizer):
    model = tiny_model(tokenizer)
    policy = HuggingFacePolicy(model, tokenizer, seed=0)
    context, generations = run(episode(policy, ["1 failed, 3 passed", "pytest -q passed"]))
    prompt = tokenizer.encode(tokenizer.apply_chat_template(TASK, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    assert context.tokens[:context.prompt_length] == prompt
    assert [t for t, m in zip(context.tokens, context.loss_mask) if m] == [t for g in generations for t in g.token_ids]
    assert [g.logprobs for g in generations] == [context.logprobs[i:i + len(g.logprobs)] for g, i in zip(
        generations, [i for i in range(len(context.tokens)) if context.loss_mask[i] and not context.loss_mask[i - 1]])]
    assert_logprobs_match_a_fresh_forward(model, context)
    assert [m["role"] for m in context.messages] == ["system", "user", "assistant", "user", "assistant", "user",
                                                     "assistant"]


def test_logprobs_are_of_the_raw_model_whatever_the_temperature_and_top_p(tokenizer):
    model = tiny_model(tokenizer)
    policy = HuggingFacePolicy(model, tokenizer, temperature=0.6, top_p=0.8, seed=1)
    context, _ = run(episode(policy, ["ls -la"]))
    assert_logprobs_match_a_fresh_forward(model, context)


def test_a_turn_stops_at_the_end_token_and_the_template_glue_follows_unmasked(tokenizer):
    model = tiny_model(tokenizer, eos_bias=40.0)  # the end token is all but certain at once
    policy = HuggingFacePolicy(model, tokenizer, seed=0)
    context, generations = run(episode(policy, ["pytest -q passed"]))
    end, newline = tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)
    for generation in generations:
        assert generation.finish_reason == "stop" and generation.token_ids == [end] and generation.text == ""
    first = context.prompt_length
    assert context.tokens[first:first + 1 + len(newline)] == [end] + newline
    assert context.loss_mask[first:first + 1 + len(newline)] == [1] + [0] * len(newline)
    # the recorded tokens are exactly the template's rendering of the conversation
    assert tokenizer.decode(context.tokens) == tokenizer.apply_chat_template(context.messages, tokenize=False)
    assert_logprobs_match_a_fresh_forward(model, context)


def test_max_tokens_cuts_a_turn_and_the_template_closes_it(tokenizer):
    model = tiny_model(tokenizer, eos_bias=-40.0)  # never ends by itself
    policy = HuggingFacePolicy(model, tokenizer, seed=0)
    context = run(policy.begin(TASK))
    generation = run(policy.act(context, 5))
    assert generation.finish_reason == "length" and len(generation.token_ids) == 5
    assert context.generated_tokens == 5
    close = tokenizer.encode("<|end|>\n", add_special_tokens=False)
    assert context.tokens[-len(close):] == close and context.loss_mask[-len(close):] == [0] * len(close)
    assert generation.text == tokenizer.decode(generation.token_ids, skip_special_tokens=True)


def test_max_context_tokens_bounds_a_turn(tokenizer):
    model = tiny_model(tokenizer, eos_bias=-40.0)
    prompt_length = len(ChatTemplateTokens(tokenizer).prompt(TASK))
    policy = HuggingFacePolicy(model, tokenizer, max_context_tokens=prompt_length + 3, seed=0)
    context = run(policy.begin(TASK))
    assert run(policy.act(context, 50)).token_ids.__len__() == 3
    full = run(policy.act(context, 50))
    assert full.finish_reason == "length" and full.token_ids == [] and context.messages[-1]["content"] == ""


def test_a_seeded_run_is_reproducible(tokenizer):
    model = tiny_model(tokenizer)

    def tokens(seed):
        return run(episode(HuggingFacePolicy(model, tokenizer, seed=seed), ["ls"]))[0].tokens

    assert tokens(7) == tokens(7)
    assert tokens(7) != tokens(8)


def test_a_keyed_rollout_samples_the_same_alone_or_batched_with_others_in_any_order(tokenizer):
    """With a seed, a rollout's turns draw from a generator keyed by (seed, rollout, turn): what
    it samples does not depend on which rollouts shared its batches or came first."""
    model = tiny_model(tokenizer)
    tasks = {name: [{"role": "user", "content": text}] for name, text in
             (("a/0", "ls"), ("b/0", "fix the bug in parser.py and run the tests"), ("c/0", "git diff"))}

    def sampled(names, seed=3):
        policy = HuggingFacePolicy(model, tokenizer, seed=seed, batch_window=0.05)

        async def one(name):
            context = await policy.begin(tasks[name])
            context.rollout = name
            await policy.act(context, 10)
            await policy.observe(context, "1 failed, 3 passed")
            await policy.act(context, 10)
            return name, context.tokens

        async def main():
            return dict(await asyncio.gather(*(one(name) for name in names)))
        return run(main()), policy.batcher.batches

    alone, batches_alone = sampled(["b/0"])
    together, batches_together = sampled(["c/0", "b/0", "a/0"])
    reversed_order, _ = sampled(["a/0", "b/0", "c/0"])
    assert max(batches_alone) == 1 and max(batches_together) == 3  # it really shared its batches
    assert together["b/0"] == alone["b/0"] == reversed_order["b/0"]
    assert together == reversed_order
    assert sampled(["b/0"], seed=4)[0]["b/0"] != alone["b/0"]  # the seed still decides
    twin = {**tasks, "b/1": tasks["b/0"]}  # another attempt of the same task draws otherwise
    tasks.update(twin)
    attempts, _ = sampled(["b/0", "b/1"])
    assert attempts["b/0"] == alone["b/0"] and attempts["b/1"] != attempts["b/0"]


def test_observation_tokens_are_a_user_turn_and_the_generation_prompt(tokenizer):
    policy = HuggingFacePolicy(tiny_model(tokenizer), tokenizer, seed=0)
    context = run(policy.begin(TASK))
    run(policy.act(context, 4))
    before = len(context.tokens)
    run(policy.observe(context, "1 failed, 3 passed"))
    assert tokenizer.decode(context.tokens[before:]) == "<|user|>1 failed, 3 passed<|end|>\n<|assistant|>"
    assert context.loss_mask[before:] == [0] * (len(context.tokens) - before)
    assert context.messages[-1] == {"role": "user", "content": "1 failed, 3 passed"}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_concurrent_turns_are_batched_and_padding_changes_no_logprob(tokenizer, arch):
    model = tiny_model(tokenizer, arch=arch)
    policy = HuggingFacePolicy(model, tokenizer, seed=0, batch_window=0.05)
    tasks = [[{"role": "user", "content": text}] for text in ("ls", "fix the bug in parser.py and run the tests",
                                                               "git diff")]

    async def main():
        contexts = [await policy.begin(task) for task in tasks]
        await asyncio.gather(*(policy.act(c, 8) for c in contexts))
        return contexts

    contexts = run(main())
    assert policy.batcher.batches == [3]
    assert len({c.prompt_length for c in contexts}) == 3  # left padding was needed
    for context in contexts:
        assert_logprobs_match_a_fresh_forward(model, context)


def test_the_model_is_handed_back_in_its_own_mode(tokenizer):
    model = tiny_model(tokenizer).train()
    policy = HuggingFacePolicy(model, tokenizer, seed=0)
    run(policy.act(run(policy.begin(TASK)), 3))
    assert model.training


def test_a_template_that_cannot_be_split_falls_back_to_plain_tokens(caplog):
    # a template that refuses assistant messages: no turn close or observation delta can be computed
    strict = make_tokenizer("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no') }}"
                            "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>")
    with caplog.at_level(logging.WARNING):
        template = ChatTemplateTokens(strict)
    assert not template.exact and "plain tokenization" in caplog.text
    assert template.turn_end == [strict.eos_token_id]
    assert template.close([5, strict.eos_token_id]) == []
    assert template.observation("ls -la") == strict.encode("ls -la", add_special_tokens=False)
    assert strict.decode(template.prompt(TASK)).endswith("<|assistant|>")


def test_a_template_that_rewrites_earlier_turns_still_splits_exactly():
    # like Qwen3: the last assistant message gets an empty think block, earlier ones do not,
    # so the shorter rendering is no prefix of the longer; the turn's close is the same in both
    qwen_like = make_tokenizer(
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}<|assistant|><think></think>"
        "{{ m['content'] }}<|end|>\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% if not thinking %}<think></think>{% endif %}{% endif %}")
    template = ChatTemplateTokens(qwen_like, template_kwargs={"thinking": False})
    assert template.exact
    assert qwen_like.decode(template.turn_end) == "<|end|>\n"
    assert qwen_like.decode(template.observation("3 passed")) == "<|user|>3 passed<|end|>\n<|assistant|><think></think>"
    assert qwen_like.decode(template.prompt(TASK)).endswith("<|assistant|><think></think>")
    thinking = ChatTemplateTokens(qwen_like, template_kwargs={"thinking": True})
    assert qwen_like.decode(thinking.observation("3 passed")).endswith("<|assistant|>")


def test_the_template_close_and_stop_tokens(tokenizer):
    template = ChatTemplateTokens(tokenizer)
    end, newline = tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)
    assert template.exact and template.turn_end == [end] + newline
    assert template.stop_ids == {end}
    assert template.close([9, end]) == newline  # the sampled end token stays trained; only the glue is added
    assert template.close([9, 10]) == [end] + newline  # a cut turn gets the whole close


def test_built_from_a_saved_model_directory(tokenizer, tmp_path):
    tiny_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    policy = build_policy("huggingface", path=str(tmp_path), dtype="float32", seed=0)
    assert isinstance(policy, HuggingFacePolicy)
    context, _ = run(episode(policy, []))
    assert_logprobs_match_a_fresh_forward(policy.model, context)
