"""OpenAICompatiblePolicy against a real HTTP server on loopback: a test double of vLLM."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchard.rollout.policies import (OpenAICompatiblePolicy, PolicyResponseError, PolicyServerError,
                                      TokenContextMismatch, bash_block, build_policy)
from orchard.rollout.policies.scripted import END_OF_TURN, decode, encode_text
from tests.rollout.vllm_double import Fault, VLLMDouble, byte_render

TASK = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "fix parser.py"}]


@pytest.fixture
def double():
    server = VLLMDouble([bash_block("ls"), bash_block("cat parser.py")])
    yield server
    server.close()


def policy_for(double, **settings):
    settings.setdefault("backoff", 0.01)
    return OpenAICompatiblePolicy(double.base_url, "tiny-coder", **settings)


def run(coroutine):
    return asyncio.run(coroutine)


async def episode(policy, observations, max_tokens=64):
    context = await policy.begin(TASK)
    generations = [await policy.act(context, max_tokens)]
    for observation in observations:
        await policy.observe(context, observation)
        generations.append(await policy.act(context, max_tokens))
    await policy.close()
    return context, generations


def test_text_mode_sends_the_conversation_and_records_messages_only(double):
    policy = policy_for(double, api_key="sk-test", temperature=0.7, top_p=0.95, seed=3, extra_body={"top_k": 20})
    context, generations = run(episode(policy, ["a.py parser.py"]))
    assert [g.text for g in generations] == [bash_block("ls"), bash_block("cat parser.py")]
    assert all(not g.token_ids and g.finish_reason == "stop" for g in generations) and not context.tokenized
    first, second = double.requests
    assert first == {"model": "tiny-coder", "messages": TASK, "max_tokens": 64, "temperature": 0.7, "top_p": 0.95,
                     "seed": 3, "top_k": 20}
    assert second["messages"] == TASK + [{"role": "assistant", "content": bash_block("ls")},
                                         {"role": "user", "content": "a.py parser.py"}]
    assert double.headers[0]["authorization"] == "Bearer sk-test"
    assert context.messages[-1] == {"role": "assistant", "content": bash_block("cat parser.py")}


def test_token_mode_records_served_prompts_and_sampled_tokens(double):
    policy = policy_for(double, token_ids=True)
    context, generations = run(episode(policy, ["a.py parser.py"]))
    body = double.requests[0]
    assert body["logprobs"] is True and body["return_tokens_as_token_ids"] is True and body["return_token_ids"] is True
    assert "return_prompt_token_ids" not in body  # an SGLang field: vLLM would warn on every request
    sampled = [encode_text(bash_block(c)) + [END_OF_TURN] for c in ("ls", "cat parser.py")]
    assert [g.token_ids for g in generations] == sampled
    assert generations[0].logprobs == pytest.approx([-0.01 * (i + 1) for i in range(len(sampled[0]))])
    assert context.prompt_length == len(byte_render(TASK))
    # the record is the last served prompt followed by what was sampled from it
    assert context.tokens == byte_render(context.messages[:-1]) + sampled[1]
    assert [t for t, m in zip(context.tokens, context.loss_mask) if m] == sampled[0] + sampled[1]
    assert sum(context.logprobs) == pytest.approx(sum(sum(g.logprobs) for g in generations))
    assert "<|user|>a.py parser.py<|end|>\n<|assistant|>" in decode(context.tokens)


def test_sampled_ids_may_come_from_the_logprob_entries_alone(double):
    double.omit_token_ids = True  # only "token_id:N" strings
    context, generations = run(episode(policy_for(double, token_ids=True), []))
    assert generations[0].token_ids == encode_text(bash_block("ls")) + [END_OF_TURN]
    assert context.tokens == byte_render(TASK) + generations[0].token_ids


def test_without_prompt_ids_token_mode_needs_a_tokenizer(double):
    double.omit_prompt_ids = True
    with pytest.raises(PolicyResponseError, match="no prompt_token_ids.*or a tokenizer"):
        run(episode(policy_for(double, token_ids=True), []))


def test_token_text_instead_of_ids_is_a_clear_error(double):
    double.omit_token_ids = True
    policy = policy_for(double, token_ids=True, extra_body={"return_tokens_as_token_ids": False})
    with pytest.raises(PolicyResponseError, match="not 'token_id:N'"):
        run(episode(policy, []))


def test_sglang_fields_and_ids_on_the_choice(double):
    policy = policy_for(double, token_ids=True, server="sglang")
    context, generations = run(episode(policy, ["ok"]))
    body = double.requests[0]
    assert body["return_prompt_token_ids"] is True and "return_tokens_as_token_ids" not in body
    assert context.tokens == byte_render(context.messages[:-1]) + generations[-1].token_ids


def test_a_served_prompt_that_rewrites_history_is_refused(double):
    double.rewrite_history = True  # like a template that drops earlier turns' reasoning
    policy = policy_for(double, token_ids=True)
    with pytest.raises(TokenContextMismatch, match="differs from the recorded context at token"):
        run(episode(policy, ["a.py"]))


def test_with_a_tokenizer_every_served_prompt_is_checked_against_the_local_record():
    from tests.rollout.tiny_lm import make_tokenizer

    tokenizer = make_tokenizer()

    def render(messages):
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)

    double = VLLMDouble(["ls -la", "git diff"], render=render, end_of_turn=tokenizer.eos_token_id,
                        encode=lambda text: tokenizer.encode(text, add_special_tokens=False))
    try:
        policy = OpenAICompatiblePolicy(double.base_url, "tiny", token_ids=True, tokenizer=tokenizer)
        context, generations = run(episode(policy, ["1 failed, 3 passed"]))
    finally:
        double.close()
    assert context.prompt_length == len(render(TASK))
    assert tokenizer.decode(context.tokens) == tokenizer.apply_chat_template(context.messages, tokenize=False)
    assert [t for t, m in zip(context.tokens, context.loss_mask) if m] == [t for g in generations for t in g.token_ids]


def test_a_cut_turn_reports_length(double):
    context, generations = run(episode(policy_for(double, token_ids=True), [], max_tokens=4))
    assert generations[0].finish_reason == "length" and generations[0].token_ids == encode_text("```b")
    assert double.requests[0]["max_tokens"] == 4


def test_rate_limits_are_retried(double):
    double.faults = [Fault(429, {"error": {"message": "slow down"}}, {"retry-after": "0"}),
                     Fault(503, {"detail": "loading"})]
    _, generations = run(episode(policy_for(double), []))
    assert generations[0].text == bash_block("ls") and len(double.requests) == 3


def test_a_timeout_is_retried(double):
    # The late answer says something of its own: which request the double answers first
    # depends on timing (a stalled CI machine once let the timed-out one take the scripted "ls").
    double.faults = [Fault(delay=1.0, then_answer=True, late_reply=bash_block("echo late"))]
    started = time.monotonic()
    _, generations = run(episode(policy_for(double, timeout=0.2), []))
    assert generations[0].text == bash_block("ls")  # the retry's answer, never the timed-out one's
    assert len(double.requests) == 2 and time.monotonic() - started < 5


def test_a_bad_request_raises_at_once_naming_status_and_message(double):
    message = "This model's maximum context length is 4096 tokens."
    double.faults = [Fault(400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400})]
    with pytest.raises(PolicyServerError) as caught:
        run(episode(policy_for(double), []))
    assert caught.value.status == 400 and caught.value.server_message == message
    assert "HTTP 400" in str(caught.value) and message in str(caught.value)
    assert len(double.requests) == 1


def test_errors_that_persist_are_raised_after_the_retries(double):
    double.faults = [Fault(502, "<html>bad gateway</html>")] * 3
    with pytest.raises(PolicyServerError, match=r"HTTP 502 after 3 attempts: <html>bad gateway") as caught:
        run(episode(policy_for(double, retries=2), []))
    assert caught.value.attempts == 3 and len(double.requests) == 3


def test_malformed_answers_are_typed_errors(double):
    double.faults = [Fault(200, '{"choices": [')]
    with pytest.raises(PolicyResponseError, match="invalid JSON"):
        run(episode(policy_for(double), []))
    double.faults = [Fault(200, {"object": "chat.completion"})]
    with pytest.raises(PolicyResponseError, match="no choices"):
        run(episode(policy_for(double), []))


def test_a_server_that_is_not_there_is_a_server_error():
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    policy = OpenAICompatiblePolicy(f"http://127.0.0.1:{port}/v1", "m", retries=1, backoff=0.01)
    with pytest.raises(PolicyServerError, match="no response after 2 attempts: ConnectError") as caught:
        run(episode(policy, []))
    assert caught.value.status is None


def test_concurrent_rollouts_share_one_client(double):
    double.replies = [bash_block(f"echo {i}") for i in range(6)]
    policy = policy_for(double, token_ids=True)

    async def main():
        contexts = [await policy.begin(TASK) for _ in range(6)]
        generations = await asyncio.gather(*(policy.act(c, 64) for c in contexts))
        await policy.close()
        return contexts, generations

    contexts, generations = run(main())
    assert sorted(g.text for g in generations) == sorted(bash_block(f"echo {i}") for i in range(6))
    for context, generation in zip(contexts, generations):
        assert context.tokens == byte_render(TASK) + generation.token_ids


def test_build_policy_openai(double):
    policy = build_policy("openai", base_url=double.base_url, model="tiny-coder", token_ids=True)
    assert isinstance(policy, OpenAICompatiblePolicy) and policy.url == double.base_url + "/chat/completions"
    with pytest.raises(ValueError, match="unknown server 'tgi'"):
        build_policy("openai", base_url=double.base_url, model="m", server="tgi")
