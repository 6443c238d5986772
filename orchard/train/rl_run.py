"""``orchard train rl --config FILE``: everything a BAR+GRPO run needs, from one YAML file.

```yaml
output_dir: runs/rl
model: ./sft-final                 # a Hugging Face checkpoint directory (the SFT result)
tasks: tasks.jsonl                 # orchard tasks; split: train by default
backend: {name: slurm, settings: {partition: gpu, shared_dir: /scratch/orchard}}
# or an Orchard server: backend: {url: "http://orchard:8000", direct: true}  (key: ORCHARD_API_KEY)
sampling: {temperature: 1.0, top_p: 1.0, seed: 0}
engine: {max_concurrent: 64, sandbox: {memory: 4Gi}}
rollout: {max_turns: 30, max_tokens_per_turn: 1024, max_total_tokens: 16384}
trainer: {steps: 150, tasks_per_step: 16, group_size: 8, max_rollouts: 32, stride: 8}
server: {base_url: "http://vllm:8000/v1", model: policy, reload_url: "http://vllm:8000/update_weights_from_disk",
         weights_dir: /scratch/weights}   # optional: sample from an inference server instead of in process
```

The backend is chosen here only; the same file with another ``backend`` runs elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from orchard.rollout.loop import RolloutConfig

KEYS = {"output_dir", "model", "tokenizer", "tasks", "split", "backend", "sampling", "engine", "rollout", "trainer",
        "server", "device", "dtype"}


def check_keys(config: dict[str, Any]) -> None:
    unknown = sorted(set(config) - KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) in the RL config: {', '.join(unknown)} (known: {', '.join(sorted(KEYS))})")
    for key in ("output_dir", "model", "tasks"):
        if key not in config:
            raise ValueError(f"the RL config needs {key!r}")


async def run(config: dict[str, Any], resume: Optional[Path] = None, progress: bool = True,
              steps: Optional[int] = None) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchard.client.aio import AsyncClient
    from orchard.rollout.engine import EngineConfig, RolloutEngine
    from orchard.rollout.policies.huggingface import HuggingFacePolicy
    from orchard.tasks import load_tasks
    from orchard.train.rl_config import RLConfig
    from orchard.train.rl_trainer import RLTrainer
    from orchard.train.weight_sync import ServerReload, SharedModel, WeightSync

    check_keys(config)
    output = Path(config["output_dir"])
    trainer_config = RLConfig(output_dir=output, **config.get("trainer", {}))
    tasks = [t for t in load_tasks(config["tasks"]) if t.split == config.get("split", "train")]
    tokenizer = AutoTokenizer.from_pretrained(config.get("tokenizer", config["model"]))
    model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=getattr(torch, config.get("dtype", "float32")))
    model = model.to(config.get("device", "cpu")).eval()
    server = config.get("server")
    sync: WeightSync
    if server:
        from orchard.rollout.policies.openai_compat import OpenAICompatiblePolicy

        policy: Any = OpenAICompatiblePolicy(server["base_url"], server["model"], server.get("api_key"),
                                             token_ids=True, tokenizer=tokenizer, **config.get("sampling", {}))
        sync = ServerReload(server["reload_url"], Path(server["weights_dir"]), tokenizer=tokenizer,
                            body_key=server.get("body_key", "model_path"))
    else:
        policy, sync = HuggingFacePolicy(model, tokenizer, **config.get("sampling", {})), SharedModel()
    engine_settings = dict(config.get("engine", {}))
    engine_config = EngineConfig(rollout=RolloutConfig(**config.get("rollout", {})), **engine_settings)
    backend = config.get("backend", {})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    if backend.get("url"):  # direct: rollouts call the sandboxes' agents, not the server
        client = AsyncClient(backend["url"], os.environ.get("ORCHARD_API_KEY"), direct=backend.get("direct", False))
    else:
        client = AsyncClient(backend=backend.get("name", "local"), backend_settings=backend.get("settings"))
    async with client:
        async with RolloutEngine(client, policy, engine_config) as engine:
            trainer = RLTrainer(model, engine, tasks, trainer_config, pad_id=pad, weight_sync=sync)
            if resume is not None:
                trainer.resume(resume)
            records = await trainer.train(steps, progress=progress)
    if trainer.finished:
        model.save_pretrained(output / "final")
        tokenizer.save_pretrained(output / "final")
    return records
