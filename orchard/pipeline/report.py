"""The pipeline's report: report.json, report.md and report.png (held-out success per stage
with 95% intervals, and the RL run's success rate per step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchard.pipeline.names import model_order, rl_rounds

GREENS = ("#2e7d32", "#1b5e20", "#104010")  # one per round of RL, the last repeated


def markdown(report: dict[str, Any]) -> str:
    results, stages = report["results"], report["stages"]
    lines = ["# orchard pipeline", "", "Held-out success (pass@1 at the sampling temperature, Wilson 95% interval):", "",
             "| model | pass rate | 95% interval | attempts | by difficulty |", "|---|---|---|---|---|"]
    for name, r in results.items():  # the recipe's stages, then any ablation arms
        levels = ", ".join(f"{k} {v:.2f}" for k, v in r["by_difficulty"].items())
        lines.append(f"| {name} | {r['pass_rate']:.3f} | {r['pass_rate_95'][0]:.3f}-{r['pass_rate_95'][1]:.3f} | "
                     f"{r['attempts']} | {levels} |")
    lines += ["", "## Stages", ""]
    for name, facts in stages.items():
        lines.append(f"- **{name}**: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    base = stages.get("base model", {})
    if base.get("built_here"):
        lines += ["", "The base model is a small transformer this run built and pre-trained on random-choice "
                      "conversations of the training tasks (no pretrained weights can be downloaded here); "
                      "its held-out success is about chance by construction."]
    credit = stages.get("credit assignment", {})
    if credit:
        lines += ["", f"Values for credit assignment: {credit.get('values')}."]
    if report.get("arm_of"):
        lines += ["", f"This run is an arm of {report['arm_of']}: `{report.get('rl_model')}` is RL with another group "
                      "sampler from that run's SFT weights, RL otherwise alike; that run's first-round RL models "
                      "are carried from its report beside it."]
    if any("(" in name for name in results):
        lines += ["", "Ablation arms: `sft (resolved|credit)` is SFT from the same base model on the other data "
                      "built from the same expert trajectories; `sft+rl (sampler)` is RL from the same SFT weights "
                      "(`sft+rl+rl (sampler)` and later rounds: from the same RL weights) with another group sampler and the "
                      "same rollout budget."]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    own = report.get("rl_model")  # an arm run's own model has its sampler in brackets
    shown = sorted((m for m in results if m == "base" or rl_rounds(m) is not None or m == own), key=model_order)
    rates = [results[s]["pass_rate"] for s in shown]
    errors = [[r - results[s]["pass_rate_95"][0] for s, r in zip(shown, rates)],
              [results[s]["pass_rate_95"][1] - r for s, r in zip(shown, rates)]]
    left.bar(shown, rates, yerr=errors, capsize=6, color=[_colour(s) for s in shown])
    left.set_ylim(0, 1)
    left.set_ylabel("held-out success")
    metrics = out_dir / "rl" / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        right.plot([r["step"] for r in records], [r["success_rate"] for r in records], marker="o")
        right.set_ylim(0, 1)
    right.set_xlabel("RL step")
    right.set_ylabel("training success rate")
    fig.tight_layout()
    fig.savefig(out_dir / "report.png", dpi=100)
    plt.close(fig)


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "report.md").write_text(markdown(report))
    plot(report, out_dir)


def _colour(model: str) -> str:
    rounds = rl_rounds(model.partition(" (")[0])
    if rounds is None:
        return "#999999"  # base
    return "#6a9fd8" if rounds == 0 else GREENS[min(rounds, len(GREENS)) - 1]
