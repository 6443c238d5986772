"""The BAR+GRPO trainer on real sandboxes: groups, advantages, updates, lost sandboxes,
checkpoints. The policy is a scripted one with byte tokens (its sampled tokens and
log-probs are recorded exactly as a model's would be), trained into a tiny Llama."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from orchard.client.aio import AsyncClient
from orchard.rollout.engine import EngineConfig, RolloutEngine
from orchard.rollout.loop import RolloutConfig
from orchard.rollout.policies.oracle import NoisyOraclePolicy
from orchard.tasks.generated import generate_suite
from orchard.train.rl_config import RLConfig
from orchard.train.rl_trainer import RLTrainer, TaskLoader


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=264, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8192)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tasks(kit_image):
    return generate_suite(4, seed=3, image=kit_image)


def _run(orchard_backend_settings, tasks, config: RLConfig, policy, steps: int, resume: Path = None, seed: int = 0):
    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            engine_config = EngineConfig(max_concurrent=4, rollout=RolloutConfig(max_turns=4))
            async with RolloutEngine(client, policy, engine_config) as engine:
                trainer = RLTrainer(tiny_llama(seed), engine, tasks, config)
                if resume is not None:
                    trainer.resume(resume)
                records = await trainer.train(steps)
                return trainer, records
    return asyncio.run(main())


def test_a_step_trains_on_balanced_groups_and_logs_metrics(orchard_backend_settings, tasks, tmp_path):
    config = RLConfig(output_dir=tmp_path, steps=2, tasks_per_step=2, group_size=2, max_rollouts=6, stride=2,
                      learning_rate=1e-2, micro_batch_size=3, loss={"tis_cap": 2.0})
    before = tiny_llama().state_dict()
    policy = NoisyOraclePolicy(tasks, 0.5, seed=1, tokenized=True)
    trainer, records = _run(orchard_backend_settings, tasks, config, policy, steps=2)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["samples"] == 4 and record["rollouts"] >= 4 and record["sandbox_errors"] == 0
        assert 0 <= record["success_rate"] <= 1 and record["loss"] is not None and record["grad_norm"] >= 0
        assert 0 < record["rss_mb"] <= record["peak_rss_mb"]  # per step: where an RL run's memory goes
    informative = sum(r["informative_groups"] for r in records)
    changed = any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert changed == (informative > 0), "weights move exactly when a group carries a signal"
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == records
    assert (tmp_path / "checkpoint-2" / "state.pt").exists() and (tmp_path / "training.png").exists()


def test_training_stops_when_the_rollout_budget_is_spent(orchard_backend_settings, tasks, tmp_path):
    """fixed-G spends exactly tasks_per_step * G a step: a budget of 10 ends after the step
    that crosses it (3 steps of 4), well before ``steps``, and a final checkpoint is written."""
    config = RLConfig(output_dir=tmp_path, steps=50, rollout_budget=10, sampler="fixed", tasks_per_step=2,
                      group_size=2, learning_rate=1e-2)
    trainer, records = _run(orchard_backend_settings, tasks, config, NoisyOraclePolicy(tasks, 0.5, seed=2,
                                                                                         tokenized=True), steps=None)
    assert [r["rollouts_spent"] for r in records] == [4, 8, 12]
    assert trainer.finished and trainer.step == 3 and (tmp_path / "checkpoint-3" / "state.pt").exists()
    with pytest.raises(ValueError, match="rollout_budget"):
        RLConfig(output_dir=tmp_path, rollout_budget=-1)


def test_dapo_trains_only_on_groups_with_both_outcomes(orchard_backend_settings, tasks, tmp_path):
    config = RLConfig(output_dir=tmp_path, steps=1, tasks_per_step=2, group_size=2, sampler="dapo",
                      dapo_max_batches=3, learning_rate=1e-3)
    trainer, [record] = _run(orchard_backend_settings, tasks, config,
                             NoisyOraclePolicy(tasks, 0.5, seed=5, tokenized=True), steps=1)
    assert record["tasks"] in (2, 4, 6) and record["rollouts"] == 2 * record["tasks"], "G per task drawn, all paid"
    assert record["samples"] == 2 * record["informative_groups"] <= 4, "only groups with a success and a failure"


def test_a_sandbox_killed_mid_training_is_counted_and_replaced(orchard_backend_settings, tasks, tmp_path,
                                                               monkeypatch):
    """Every other rollout's sandbox is killed from the host as its episode starts (as a
    cancelled Slurm job or an evicted pod would be): those rollouts are aborted (never -1),
    counted, and BAR draws valid ones in their place; the run goes on."""
    import orchard.rollout.engine as engine_module
    from tests.rollout.test_rollout_loop import _holder_pid

    real_episode = engine_module.run_episode
    calls = {"n": 0}

    async def sometimes_lost(policy, sandbox, task, config, attempt=0):
        calls["n"] += 1
        if calls["n"] % 2 == 1:
            os.kill(await _holder_pid(sandbox), signal.SIGKILL)
        return await real_episode(policy, sandbox, task, config, attempt)

    monkeypatch.setattr(engine_module, "run_episode", sometimes_lost)
    config = RLConfig(output_dir=tmp_path, steps=2, tasks_per_step=2, group_size=2, max_rollouts=8, stride=2,
                      learning_rate=1e-3)
    trainer, records = _run(orchard_backend_settings, tasks, config, NoisyOraclePolicy(tasks, 1.0, tokenized=True),
                            steps=2)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["sandbox_errors"] >= 1 for r in records), records
    for record in records:  # the cause is kept: which error, how often, and what it said
        assert sum(record["sandbox_error_causes"].values()) == record["sandbox_errors"], record
        assert set(record["sandbox_error_examples"]) == set(record["sandbox_error_causes"]), record
        assert set(record["sandbox_error_causes"]) == {"sandbox_lost"}, record
        assert "holder exited" in record["sandbox_error_examples"]["sandbox_lost"], record
    assert all(r["samples"] == 4 for r in records), "every group was filled with valid rollouts in their place"


def test_a_resumed_run_continues_exactly_where_it_stopped(orchard_backend_settings, tasks, tmp_path):
    """Two steps straight, or one step, a checkpoint, a new process's worth of objects and one
    more step: the same weights, bit for bit (CPU; one rollout at a time, so rollouts are
    drawn in the same order)."""
    def config(path):
        return RLConfig(output_dir=path, steps=2, tasks_per_step=2, group_size=2, max_rollouts=4, stride=2,
                        learning_rate=1e-2, save_every=1)

    def run(path, steps, resume=None):
        async def main():
            async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
                policy = NoisyOraclePolicy(tasks, 0.5, seed=9, tokenized=True)
                engine_config = EngineConfig(max_concurrent=1, rollout=RolloutConfig(max_turns=4))
                async with RolloutEngine(client, policy, engine_config) as engine:
                    trainer = RLTrainer(tiny_llama(), engine, tasks, config(path))
                    if resume is not None:
                        trainer.resume(resume)
                    await trainer.train(steps)
                    return trainer.model.state_dict(), engine.state_dict()
        return asyncio.run(main())

    straight, straight_attempts = run(tmp_path / "straight", 2)
    run(tmp_path / "split", 1)
    resumed, resumed_attempts = run(tmp_path / "split", 1, resume=tmp_path / "split" / "checkpoint-1")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    # rollouts after the resume are named (and a seeded policy's draws keyed) as without it
    assert resumed_attempts == straight_attempts and sum(straight_attempts.values()) > 0
    first = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    second = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "samples", "reward", "success_rate", "rollouts", "loss")
    assert [{k: r[k] for k in keys} for r in first] == [{k: r[k] for k in keys} for r in second]


def test_the_task_loader_reshuffles_per_epoch_and_resumes():
    loader = TaskLoader(list(range(5)), seed=4)  # type: ignore[arg-type]
    first = loader.next(7)
    state = loader.state_dict()
    following = loader.next(4)
    again = TaskLoader(list(range(5)), seed=4)  # type: ignore[arg-type]
    again.load_state_dict(state)
    assert again.next(4) == following and sorted(first[:5]) == [0, 1, 2, 3, 4]


def test_orchard_train_rl_runs_from_a_config_file(orchard_backend_settings, tasks, tmp_path):
    """The CLI with a Hugging Face model sampling in process (a tiny random one: its turns are
    gibberish, graded -1, so this checks the wiring, not learning)."""
    import transformers
    import yaml
    from click.testing import CliRunner

    from orchard.cli.main import cli
    from orchard.tasks import save_tasks
    from tests.rollout.tiny_lm import make_tokenizer

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    save_tasks(tasks[:1], tmp_path / "tasks.jsonl")
    config = {"output_dir": str(tmp_path / "run"), "model": str(tmp_path / "model"), "tasks": str(tmp_path / "tasks.jsonl"),
              "backend": {"name": "local", "settings": orchard_backend_settings["local"]},
              "sampling": {"seed": 0}, "engine": {"max_concurrent": 2},
              "rollout": {"max_turns": 1, "max_tokens_per_turn": 8},
              "trainer": {"steps": 1, "tasks_per_step": 1, "group_size": 2, "max_rollouts": 2, "stride": 2}}
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["train", "rl", "--config", str(tmp_path / "rl.yaml")])
    assert result.exit_code == 0, result.output
    [record] = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["rollouts"] == 2 and record["samples"] == 2 and record["success_rate"] == 0.0
    assert (tmp_path / "run" / "final" / "config.json").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**config, "trainr": {}}))
    refused = CliRunner().invoke(cli, ["train", "rl", "--config", str(bad)])
    assert refused.exit_code != 0 and "trainr" in refused.output
