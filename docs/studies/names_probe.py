"""Does a model find the bug by a name it has seen? (results.md, session 25)

Each seed's SFT model (or an RL model) on the same 120 training-split RL tasks twice: as
generated (each variant's own names) and generated with fresh names (same task ids,
variants, levels; other draws), 1 attempt each. Run from the repository root after the
runs it reads: python docs/studies/names_probe.py SEED sft|rl|fresh"""
import asyncio, json, re, sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from orchard.pipeline.run import Pipeline, PipelineConfig
from orchard.client.aio import AsyncClient
from orchard.tasks import load_tasks

N = 120

def first_pick(path):
    rows = [json.loads(l) for l in open(path)]
    inner = 0
    for r in rows:
        frames = re.findall(r"\(candidate (\d+)\)", r["messages"][1]["content"])
        cmds = [t.get("command") or "" for t in r["turns"]]
        picks = [m.group(1) for m in (re.search(r"candidates/(\d+)", c) for c in cmds) if m]
        inner += bool(picks) and picks[0] == frames[-1]
    return round(inner / len(rows), 3)

async def main(seed: int, which: str) -> None:
    out = Path(f"runs/names-probe/{which}-{seed}")
    out.mkdir(parents=True, exist_ok=True)
    config = PipelineConfig(output_dir=out, seed=seed, world_seed=0, split_seed=0, eval_attempts=1)
    pipe = Pipeline(config, progress=False)
    model_dir = {"sft": Path(f"runs/world0-shared/seed-{seed}/sft"),
                 "rl": Path(f"runs/world0-shared-lr2e-4-kl02/seed-{seed}/rl"),
                 "fresh": Path(f"runs/world0-fresh-names/seed-{seed}/rl")}[which]
    ckpt = sorted(model_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    tokenizer = AutoTokenizer.from_pretrained(f"runs/world0-shared/seed-{seed}/base")
    import torch
    model = AutoModelForCausalLM.from_pretrained(f"runs/world0-shared/seed-{seed}/base")
    model.load_state_dict(torch.load(ckpt / "state.pt", weights_only=False)["model"])
    model.eval()
    named = load_tasks(f"runs/world0-shared-lr2e-4-kl02/seed-{seed}/rl-tasks.jsonl")[:N]
    fresh = load_tasks(f"runs/world0-fresh-names/seed-{seed}/rl-tasks.jsonl")[:N]
    assert [t.task_id for t in named] == [t.task_id for t in fresh]
    result = {"seed": seed, "model": which, "checkpoint": str(ckpt)}
    async with AsyncClient(backend="local") as client:
        pipe.client = client
        for name, tasks in (("own-names", named), ("fresh-names", fresh)):
            r = await pipe.evaluate(name, model, tokenizer, tasks)
            result[name] = {"pass_rate": r["pass_rate"], "first_pick_is_last_frame": first_pick(out / f"eval-{name}.jsonl")}
    json.dump(result, open(out / "result.json", "w"))
    print(json.dumps(result), flush=True)

asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
