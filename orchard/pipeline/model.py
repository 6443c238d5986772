"""The CPU pipeline's base model: a small transformer and a tokenizer made here, pre-trained
briefly on text of the task families.

No language-model weights can be downloaded on the machines this runs on, so the base
model is built from a config: a byte-level BPE tokenizer trained on the tasks' text and a
few-layer Llama. Pre-training teaches it the chat format and the action format on
conversations whose choices are *random* (so it learns how to act, not which candidate is
right): its held-out success is about chance, the floor SFT and RL start from. A real run
passes a Hugging Face checkpoint path instead and skips all of this.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from orchard.pipeline.expert import TEST_COMMAND, apply_command
from orchard.rollout.actions import SUBMIT_TURN, bash_block
from orchard.rollout.loop import RolloutConfig, task_messages
from orchard.tasks import Task

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass
class BaseModelConfig:
    vocab_size: int = field(default=1024, metadata={"help": "BPE vocabulary (trained on the tasks' text)"})
    hidden_size: int = field(default=96, metadata={"help": "transformer width"})
    layers: int = field(default=4, metadata={"help": "transformer layers"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    pretrain_steps: int = field(default=150, metadata={"help": "language-model steps on random-choice conversations"})
    pretrain_batch: int = field(default=16, metadata={"help": "conversations per pre-training step"})
    pretrain_lr: float = field(default=3e-3, metadata={"help": "pre-training learning rate"})


def random_conversation(task: Task, system: str, rng: random.Random) -> list[dict[str, str]]:
    """A task acted on with a random candidate: the format, never the skill."""
    pick = rng.choice(task.metadata["choice"]["candidates"])
    verdict = "OK" if pick == task.metadata["choice"]["fix"] else f"FAILED (failures={rng.randint(1, 3)})"
    return [*task_messages(task, RolloutConfig(system_prompt=system)),  # the prompt exactly as rollouts see it
            {"role": "assistant", "content": bash_block(apply_command(pick))},
            {"role": "user", "content": "exit code: 0"},
            {"role": "assistant", "content": bash_block(TEST_COMMAND)},
            {"role": "user", "content": f"exit code: 0\n{verdict}\n"},
            {"role": "assistant", "content": SUBMIT_TURN}]


def build_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(texts), vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                            show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>",
                                                     additional_special_tokens=SPECIALS[2:])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def build_model(tokenizer: Any, config: BaseModelConfig, seed: int) -> Any:
    import transformers

    torch.manual_seed(seed)
    llama = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.hidden_size * 8 // 3,
        num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.heads,
        max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(llama).to(torch.float32)


def pretrain(model: Any, tokenizer: Any, tasks: Sequence[Task], system: str, config: BaseModelConfig, seed: int,
             progress: Any = None) -> list[float]:
    """Next-token loss on every token of random-choice conversations; returns the losses."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.pretrain_lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10)
                                                 * max(0.1, 1 - s / max(1, config.pretrain_steps)))
    losses = []
    model.train()
    for _ in range(config.pretrain_steps):
        texts = [tokenizer.apply_chat_template(random_conversation(rng.choice(list(tasks)), system, rng),
                                               tokenize=False) for _ in range(config.pretrain_batch)]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress()
    model.eval()
    return losses
