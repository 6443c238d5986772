"""A tokenizer and a tiny random causal LM built here (nothing downloaded), as in tests/train/test_sft.py."""

from __future__ import annotations

from typing import Any, Optional

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["run the tests", "ls -la", "pytest -q passed", "edit the file", "fix the bug in parser.py",
          "1 failed, 3 passed", "cat README.md", "git diff", "```bash\nsubmit\n```"] * 20
SPECIALS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def make_tokenizer(template: str = TEMPLATE) -> Any:
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=SPECIALS)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>",
                                                     additional_special_tokens=SPECIALS[2:])
    tokenizer.chat_template = template
    return tokenizer


def tiny_model(tokenizer: Any, seed: int = 0, eos_bias: Optional[float] = None, arch: str = "llama") -> Any:
    """A 2-layer Llama (rotary positions) or GPT-2 (absolute positions: padding mistakes show);
    ``eos_bias`` adds that much to the end token's logit (+: stops at once, -: never)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=None)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=256,
                                                                     **ids)).to(torch.float32)
        config = model.config  # GPT2Config maps hidden_size to n_embd
    else:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                          **ids)
        model = transformers.LlamaForCausalLM(config).to(torch.float32)
    if eos_bias is not None:
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.zero_()
            head.bias[tokenizer.eos_token_id] = eos_bias
        model.lm_head = head
    return model.eval()


def fresh_logprobs(model: Any, tokens: list[int]) -> list[float]:
    """log p(token i | tokens before i) for i >= 1, from one plain forward pass (what a trainer computes)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1).tolist()
