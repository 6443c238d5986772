"""Masked SFT on a tiny random model and a tokenizer built here (nothing downloaded)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from orchard.train.sft_data import tokenize_example  # noqa: E402
from orchard.train.sft_trainer import SFTConfig, SFTTrainer, cosine_with_warmup, masked_loss_sum  # noqa: E402

TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}")
CORPUS = ["run the tests", "ls -la", "pytest -q passed", "edit the file", "fix the bug in parser.py",
          "1 failed, 3 passed", "cat README.md", "git diff"] * 20


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    specials = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=specials)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>",
                                               additional_special_tokens=specials[2:])
    tok.chat_template = TEMPLATE
    return tok


def tiny_model(tokenizer, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id)
    return transformers.LlamaForCausalLM(config).to(torch.float64)


MESSAGES = [
    {"role": "user", "content": "fix the bug in parser.py", "loss_mask": 0},
    {"role": "assistant", "content": "cat README.md", "loss_mask": 0},
    {"role": "user", "content": "1 failed, 3 passed", "loss_mask": 0},
    {"role": "assistant", "content": "edit the file", "loss_mask": 1},
    {"role": "user", "content": "pytest -q passed", "loss_mask": 0},
    {"role": "assistant", "content": "git diff", "loss_mask": 1},
]


def examples(tokenizer, n=8):
    return [tokenize_example(tokenizer, MESSAGES[: 2 + 2 * (i % 3)], 128) for i in range(n)]


def test_decoding_the_masked_tokens_gives_exactly_the_trained_assistant_text(tokenizer):
    example = tokenize_example(tokenizer, MESSAGES, 128)
    trained = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    assert tokenizer.decode(trained, skip_special_tokens=True) == "edit the file" + "git diff"
    assert tokenizer.decode(example.input_ids) == tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in MESSAGES], tokenize=False)


def test_tokens_outside_the_mask_get_zero_gradient(tokenizer):
    model = tiny_model(tokenizer)
    example = tokenize_example(tokenizer, MESSAGES, 128)
    captured = {}

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = model.lm_head.register_forward_hook(keep_logits)
    loss, count = masked_loss_sum(model, [example], tokenizer.pad_token_id)
    loss.backward()
    handle.remove()
    grad = captured["logits"].grad[0]
    targets = torch.tensor(example.loss_mask[1:] + [0], dtype=torch.bool)  # logits at t predict token t+1
    assert count == int(targets.sum())
    assert torch.all(grad[~targets] == 0) and torch.any(grad[targets] != 0)


def test_gradient_accumulation_gives_the_full_batch_update(tokenizer, tmp_path):
    data = examples(tokenizer, 8)
    params = []
    for micro in (8, 2):
        model = tiny_model(tokenizer)
        config = SFTConfig(output_dir=tmp_path / f"m{micro}", epochs=1, global_batch_size=8, micro_batch_size=micro,
                           learning_rate=1e-3, warmup_ratio=0.0)
        SFTTrainer(model, data, config, tokenizer.pad_token_id).train()
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-10)


def test_resumed_run_is_bitwise_identical(tokenizer, tmp_path):
    data = examples(tokenizer, 8)
    config = dict(epochs=3, global_batch_size=4, micro_batch_size=2, learning_rate=1e-3, warmup_ratio=0.2)
    straight_model = tiny_model(tokenizer)
    straight = SFTTrainer(straight_model, data, SFTConfig(output_dir=tmp_path / "a", **config), tokenizer.pad_token_id)
    straight.train()
    first = SFTTrainer(tiny_model(tokenizer), data, SFTConfig(output_dir=tmp_path / "b", **config), tokenizer.pad_token_id)
    first.train(stop_after=3)
    checkpoint = first.save()
    resumed_model = tiny_model(tokenizer, seed=123)  # different init: everything must come from the checkpoint
    resumed = SFTTrainer(resumed_model, data, SFTConfig(output_dir=tmp_path / "b", **config), tokenizer.pad_token_id)
    resumed.resume(checkpoint)
    resumed.train()
    for a, b in zip(straight_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    metrics = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 6 and metrics[-1]["loss"] < metrics[0]["loss"]
    assert (tmp_path / "a" / "loss.png").exists() and (tmp_path / "a" / "checkpoint-6" / "state.pt").exists()


def test_cosine_schedule_with_warmup():
    lrs = [cosine_with_warmup(s, 100, 10, 1e-5, 1e-6) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-6) and lrs[9] == pytest.approx(1e-5)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(1e-6, rel=0.01)


def test_train_sft_command(tokenizer, tmp_path):
    import subprocess
    import sys

    model_dir = tmp_path / "tiny"
    tiny_model(tokenizer).to(torch.float32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": MESSAGES[: 2 + 2 * (i % 3)]}) + "\n" for i in range(8)))
    result = subprocess.run([sys.executable, "-m", "orchard.cli", "train", "sft", "--model", str(model_dir),
                             "--data", str(data), "--output", str(tmp_path / "out"), "--epochs", "2",
                             "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # rows 0, 3 and 6 hold no assistant turn: nothing to train on, skipped and said so; 5 rows at 4 per step
    assert "3 example(s) have no trained token" in result.stdout and "2 steps" in result.stdout
    assert (tmp_path / "out" / "final" / "config.json").exists() and (tmp_path / "out" / "loss.png").exists()


def test_packing_changes_nothing_but_the_padding(tokenizer):
    model = tiny_model(tokenizer)
    batch = examples(tokenizer, 6)
    plain, plain_count = masked_loss_sum(model, batch, tokenizer.pad_token_id)
    plain_grad = torch.autograd.grad(plain, list(model.parameters()))
    packed, packed_count = masked_loss_sum(model, batch, tokenizer.pad_token_id, pack_length=64)
    packed_grad = torch.autograd.grad(packed, list(model.parameters()))
    assert packed_count == plain_count and torch.allclose(packed, plain, atol=1e-9)
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(plain_grad, packed_grad))


def test_gradient_checkpointing_gives_the_same_update(tokenizer, tmp_path):
    data = examples(tokenizer, 4)
    params = []
    for checkpointing in (False, True):
        model = tiny_model(tokenizer)
        config = SFTConfig(output_dir=tmp_path / str(checkpointing), epochs=1, global_batch_size=4,
                           micro_batch_size=2, learning_rate=1e-3, warmup_ratio=0.0,
                           gradient_checkpointing=checkpointing)
        SFTTrainer(model, data, config, tokenizer.pad_token_id).train()
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-10)


def long_conversation(turns):
    messages = [{"role": "system", "content": "cat README.md", "loss_mask": 0},
                {"role": "user", "content": "fix the bug in parser.py", "loss_mask": 0}]
    for i in range(turns):
        messages += [{"role": "assistant", "content": "edit the file", "loss_mask": 0},
                     {"role": "user", "content": "1 failed, 3 passed", "loss_mask": 0}]
    return messages + [{"role": "assistant", "content": "git diff", "loss_mask": 1}]


def test_truncation_keeps_the_task_and_the_end_and_drops_the_oldest_turns(tokenizer):
    messages = long_conversation(30)
    full = tokenize_example(tokenizer, messages, 10_000)
    example = tokenize_example(tokenizer, messages, 80)
    assert len(full.input_ids) > 80 >= len(example.input_ids)
    trained = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    assert tokenizer.decode(trained, skip_special_tokens=True) == "git diff"  # the last trained action survives
    assert example.input_ids[-len(trained):] == full.input_ids[-len(trained):]
    # what is left is the conversation without its oldest whole turns: system, task, the latest turns
    kept = [m for m in messages[:2]]
    text = tokenizer.decode(example.input_ids)
    dropped = 0
    while tokenizer.apply_chat_template(kept + messages[2 + 2 * dropped:], tokenize=False) != text:
        dropped += 1
        assert 2 + 2 * dropped < len(messages), "not the conversation minus its oldest turns"
    assert dropped > 0 and example.dropped_messages == 2 * dropped


def test_truncation_keeps_the_end_even_when_one_turn_is_too_long(tokenizer):
    messages = [{"role": "user", "content": "fix the bug", "loss_mask": 0},
                {"role": "assistant", "content": "git diff " * 60 + "pytest -q", "loss_mask": 1}]
    example = tokenize_example(tokenizer, messages, 40)
    assert len(example.input_ids) == 40 and example.loss_mask[-1] == 1
    assert tokenizer.decode(example.input_ids, skip_special_tokens=True).endswith("git diff pytest -q")
    assert tokenizer.decode(example.input_ids).startswith("<|user|>fix the bug<|end|>")
