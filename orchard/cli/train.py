"""``orchard train sft``: masked SFT of a Hugging Face causal LM on an `orchard credit` dataset;
``orchard train rl``: BAR+GRPO in sandboxes (see orchard/train/rl_run.py for the config file)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from orchard.cli.common import handle_errors, out


@click.group()
def train() -> None:
    """Trainers (torch; install the `train` extra)."""


@train.command("sft")
@click.option("--model", "model_path", required=True, help="a local Hugging Face model directory (or hub name)")
@click.option("--data", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="JSONL of {messages: [{role, content, loss_mask}]} (what `orchard credit` writes)")
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--epochs", type=int, default=5, show_default=True)
@click.option("--lr", type=float, default=1e-5, show_default=True)
@click.option("--min-lr", type=float, default=1e-6, show_default=True)
@click.option("--global-batch", type=int, default=128, show_default=True)
@click.option("--micro-batch", type=int, default=1, show_default=True)
@click.option("--max-length", type=int, default=65536, show_default=True)
@click.option("--gradient-checkpointing", is_flag=True)
@click.option("--pack-length", type=int, default=0, show_default=True, help="pack examples into rows of this many tokens")
@click.option("--resume", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, ...")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@handle_errors
def sft(model_path: str, data: Path, output: Path, epochs: int, lr: float, min_lr: float, global_batch: int,
        micro_batch: int, max_length: int, gradient_checkpointing: bool, pack_length: int, resume: Path | None, device: str,
        dtype: str) -> None:
    """Train on the loss-masked tokens only; checkpoints, metrics.jsonl and loss.png go to OUTPUT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchard.train.sft_data import tokenize_example
    from orchard.train.sft_trainer import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    examples = [tokenize_example(tokenizer, row["messages"], max_length) for row in rows]
    trained = [e for e in examples if sum(e.loss_mask[1:])]  # truncation can leave a row nothing to learn
    if len(trained) < len(examples):
        out.print(f"{len(examples) - len(trained)} example(s) have no trained token left after truncation: skipped")
    examples = trained
    config = SFTConfig(output_dir=output, epochs=epochs, learning_rate=lr, min_learning_rate=min_lr,
                       global_batch_size=global_batch, micro_batch_size=micro_batch,
                       gradient_checkpointing=gradient_checkpointing, pack_length=pack_length)
    trainer = SFTTrainer(model, examples, config, tokenizer.pad_token_id or 0)
    if resume:
        trainer.resume(resume)
    records = trainer.train(progress=True)
    model.save_pretrained(output / "final")
    tokenizer.save_pretrained(output / "final")
    out.print(f"{trainer.step} steps; last loss {records[-1]['loss']:.4f}" if records else "nothing to do")


@train.command("rl")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="YAML: output_dir, model, tasks, backend, sampling, engine, rollout, trainer, server")
@click.option("--resume", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option("--steps", type=int, default=None, help="stop after this many more steps")
@handle_errors
def rl(config_file: Path, resume: Path | None, steps: int | None) -> None:
    """BAR+GRPO: rollouts in sandboxes from the rollout engine, GRPO updates, checkpoints,
    metrics.jsonl and training.png in output_dir."""
    import asyncio

    import yaml

    from orchard.train.rl_run import check_keys, run

    config = yaml.safe_load(config_file.read_text()) or {}
    try:
        check_keys(config)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    records = asyncio.run(run(config, resume, progress=True, steps=steps))
    if records:
        last = records[-1]
        out.print(f"step {last['step']}: success rate {last['success_rate']}, reward {last['reward']}, "
                  f"rollouts {last['rollouts']}, sandbox errors {last['sandbox_errors']}")
    else:
        out.print("nothing to do")
