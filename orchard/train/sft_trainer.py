"""Masked SFT for any Hugging Face causal LM: cross-entropy on the trained tokens only.

The loss is normalized per token over the whole global batch (not per micro-batch), so
gradient accumulation gives the update a full batch would. Checkpoints hold the model,
optimizer, scheduler, RNG states and the data position: a resumed run continues exactly
where it stopped (bitwise, on CPU).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from orchard.train.sft_data import TokenizedExample


@dataclass
class SFTConfig:
    output_dir: Path = field(metadata={"help": "checkpoints, metrics.jsonl, loss.png"})
    epochs: int = field(default=5, metadata={"help": "passes over the data"})
    learning_rate: float = field(default=1e-5, metadata={"help": "peak learning rate"})
    min_learning_rate: float = field(default=1e-6, metadata={"help": "cosine schedule floor"})
    warmup_ratio: float = field(default=0.03, metadata={"help": "share of steps spent warming up linearly"})
    global_batch_size: int = field(default=128, metadata={"help": "examples per optimizer step"})
    micro_batch_size: int = field(default=1, metadata={"help": "examples per forward pass"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "trade compute for memory"})
    pack_length: int = field(default=0, metadata={
        "help": "pack each micro-batch's examples into rows of up to this many tokens (0: no packing); "
                "a block-diagonal attention mask keeps examples from seeing each other"})
    save_every: int = field(default=0, metadata={"help": "optimizer steps between checkpoints (0: at the end)"})
    seed: int = field(default=0, metadata={"help": "data order and initialization"})

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")

    @property
    def accumulation(self) -> int:
        return self.global_batch_size // self.micro_batch_size


def cosine_with_warmup(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _rows(batch: list[TokenizedExample], pack_length: int) -> list[list[TokenizedExample]]:
    """Examples in order, greedily packed into rows of at most ``pack_length`` tokens."""
    if not pack_length:
        return [[example] for example in batch]
    rows: list[list[TokenizedExample]] = []
    for example in batch:
        if rows and sum(len(e.input_ids) for e in rows[-1]) + len(example.input_ids) <= pack_length:
            rows[-1].append(example)
        else:
            rows.append([example])
    return rows


def masked_loss_sum(model: Any, batch: list[TokenizedExample], pad_id: int,
                    pack_length: int = 0) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies over trained tokens, and how many there were.
    Packed or not, the result is the same: packed examples cannot attend to each other
    (block-diagonal causal mask) and positions restart at each example."""
    device = next(model.parameters()).device
    rows = _rows(batch, pack_length)
    length = max(sum(len(e.input_ids) for e in row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    positions = torch.zeros((len(rows), length), dtype=torch.long)
    segments = torch.full((len(rows), length), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for s, example in enumerate(row):
            n = len(example.input_ids)
            span = slice(start, start + n)
            ids[r, span] = torch.tensor(example.input_ids)
            trained = torch.tensor(example.loss_mask, dtype=torch.bool)
            trained[0] = False  # nothing predicts an example's first token
            labels[r, span] = torch.where(trained, ids[r, span], torch.tensor(-100))
            positions[r, span] = torch.arange(n)
            segments[r, span] = s
            start += n
    if pack_length:
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
        same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] >= 0)
        attention = (same & causal) | torch.eye(length, dtype=torch.bool)  # padding attends to itself only
        extra = {"attention_mask": attention[:, None].to(device), "position_ids": positions.to(device)}
    else:
        extra = {"attention_mask": (segments >= 0).long().to(device)}
    logits = model(input_ids=ids.to(device), **extra).logits
    shifted_logits, shifted_labels = logits[:, :-1], labels[:, 1:].to(device)
    loss = torch.nn.functional.cross_entropy(shifted_logits.reshape(-1, shifted_logits.size(-1)).float(),
                                             shifted_labels.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, int((shifted_labels != -100).sum())


class SFTTrainer:
    def __init__(self, model: Any, examples: list[TokenizedExample], config: SFTConfig, pad_id: int = 0) -> None:
        self.model, self.examples, self.config, self.pad_id = model, examples, config, pad_id
        if config.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.steps_per_epoch = len(examples) // config.global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(examples)} examples are fewer than one global batch of {config.global_batch_size}")
        self.total_steps = self.steps_per_epoch * config.epochs
        warmup = int(config.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: cosine_with_warmup(
            s, self.total_steps, warmup, config.learning_rate, config.min_learning_rate) / config.learning_rate)
        self.step = 0
        config.output_dir.mkdir(parents=True, exist_ok=True)

    def _order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.config.seed * 1000 + epoch)
        return torch.randperm(len(self.examples), generator=generator).tolist()

    def train(self, stop_after: Optional[int] = None, progress: bool = False) -> list[dict]:
        """Train to the end (or for ``stop_after`` more optimizer steps); returns the metrics."""
        from rich.progress import Progress

        records = []
        target = self.total_steps if stop_after is None else min(self.total_steps, self.step + stop_after)
        self.model.train()
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("sft", total=self.total_steps, completed=self.step)
            while self.step < target:
                records.append(self._optimizer_step())
                bar.update(task, completed=self.step)
                if self.config.save_every and self.step % self.config.save_every == 0:
                    self.save()
        if self.step == self.total_steps:
            self.save()
            self.plot()
        return records

    def _optimizer_step(self) -> dict:
        config = self.config
        epoch, within = divmod(self.step, self.steps_per_epoch)
        order = self._order(epoch)
        batch = [self.examples[i] for i in order[within * config.global_batch_size:(within + 1) * config.global_batch_size]]
        micro = [batch[i:i + config.micro_batch_size] for i in range(0, len(batch), config.micro_batch_size)]
        tokens = sum(sum(e.loss_mask[1:]) for e in batch)  # next-token targets: the first token has none
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for part in micro:
            loss_sum, _ = masked_loss_sum(self.model, part, self.pad_id, config.pack_length)
            (loss_sum / max(tokens, 1)).backward()
            total += float(loss_sum.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        record = {"step": self.step, "epoch": epoch, "loss": total / max(tokens, 1), "lr": lr,
                  "grad_norm": grad_norm, "tokens": tokens}
        with open(config.output_dir / "metrics.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")
        return record

    def save(self) -> Path:
        path = self.config.output_dir / f"checkpoint-{self.step}"
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "step": self.step,
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                    "config": {k: str(v) for k, v in asdict(self.config).items()}}, path / "state.pt")
        return path

    def resume(self, path: Path) -> None:
        state = torch.load(Path(path) / "state.pt", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = [json.loads(line) for line in (self.config.output_dir / "metrics.jsonl").read_text().splitlines()]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["step"] for r in records], [r["loss"] for r in records])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("masked token loss")
        fig.tight_layout()
        fig.savefig(self.config.output_dir / "loss.png", dpi=100)
        plt.close(fig)
