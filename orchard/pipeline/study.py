"""The pipeline over several seeds, with its ablations: is each gap larger than the seed-to-seed spread?

Each seed is a whole run (its own tasks, base model, expert, SFT and RL) in ``seed-N/``. The
summary gives, per model (``base``, ``sft``, ``sft+rl``, any further round of RL and any
ablation arm; ``orchard.pipeline.names``), the held-out
success of every seed, the mean and the sample standard deviation across seeds, and for
each comparison the per-seed (paired) gaps. A gap counts as *beyond the seed spread* when
the difference of the means exceeds the sum of the two models' standard deviations and
every seed's own gap has the same sign: a conservative reading for three to five seeds.

Beside it the summary gives the paired reading, which compares each seed with itself: the
mean of the per-seed gaps, their standard deviation, Student's t on n - 1 degrees of freedom,
and whether the gap is *beyond the paired spread* (t above its two-sided 95% value). Seeds
that differ from each other a lot (one weaker SFT model) weigh on the first reading, not on
this one; the studies report both and say which one they call met.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

from orchard.pipeline.chain import dig
from orchard.pipeline.names import comparisons, model_of_slug, model_order
from orchard.pipeline.run import PipelineConfig, model_names, reused_models, run_pipeline, sibling_models

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom; above 30 the normal's.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_reading(paired: Sequence[float]) -> dict[str, Any]:
    """Mean and standard deviation of per-seed gaps, Student's t and whether it is beyond
    its two-sided 95% value (never for fewer than two seeds; infinite t when every seed
    moved by the same non-zero amount)."""
    if len(paired) < 2:
        return {"mean": paired[0] if paired else 0.0, "std": 0.0, "t": None, "beyond": False}
    mean, std = statistics.fmean(paired), statistics.stdev(paired)
    if std == 0:
        t = None if mean == 0 else float("inf") * (1 if mean > 0 else -1)
    else:
        t = mean / (std / len(paired) ** 0.5)
    critical = T_975[len(paired) - 2] if len(paired) - 1 <= len(T_975) else 1.960
    return {"mean": mean, "std": std, "t": t, "beyond": t is not None and abs(t) > critical}


def summarize(per_seed: dict[int, dict[str, float]]) -> dict[str, Any]:
    """``per_seed``: seed -> model -> held-out success (a model some seeds lack is summarized
    over the seeds that have it, and compared only on those)."""
    models = sorted(dict.fromkeys(m for results in per_seed.values() for m in results), key=model_order)
    table = {}
    for model in models:
        seeds = [seed for seed in per_seed if model in per_seed[seed]]
        values = [per_seed[seed][model] for seed in seeds]
        table[model] = {"seeds": seeds, "values": values, "mean": statistics.fmean(values),
                        "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    gaps = []
    for worse, better in comparisons(models):
        both = [seed for seed in per_seed if worse in per_seed[seed] and better in per_seed[seed]]
        paired = [per_seed[seed][better] - per_seed[seed][worse] for seed in both]
        mean_gap = table[better]["mean"] - table[worse]["mean"]
        spread = table[better]["std"] + table[worse]["std"]
        same_sign = all(g > 0 for g in paired) or all(g < 0 for g in paired)
        gaps.append({"from": worse, "to": better, "seeds": both, "gap": mean_gap, "paired": paired, "spread": spread,
                     "beyond_spread": len(paired) > 1 and abs(mean_gap) > spread and same_sign,
                     "paired_reading": paired_reading(paired)})
    return {"seeds": list(per_seed), "models": table, "gaps": gaps}


def markdown(summary: dict[str, Any]) -> str:
    seeds = summary["seeds"]
    lines = ["# orchard pipeline over seeds", "", f"Held-out success per seed ({', '.join(map(str, seeds))}), "
             "mean and standard deviation across seeds:", "",
             "| model | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | std |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for model, row in summary["models"].items():
        value = dict(zip(row["seeds"], row["values"]))
        lines.append(f"| {model} | " + " | ".join(f"{value[s]:.3f}" if s in value else "-" for s in seeds)
                     + f" | {row['mean']:.3f} | {row['std']:.3f} |")
    lines += ["", "| comparison | gap of means | per-seed gaps | sum of stds | beyond the seed spread "
              "| paired: std of gaps, t | beyond the paired spread |", "|---|---|---|---|---|---|---|"]
    for gap in summary["gaps"]:
        reading = gap["paired_reading"]
        t = "-" if reading["t"] is None else f"{reading['t']:+.1f}"
        lines.append(f"| {gap['from']} -> {gap['to']} | {gap['gap']:+.3f} | "
                     + ", ".join(f"{g:+.3f}" for g in gap["paired"])
                     + f" | {gap['spread']:.3f} | {'yes' if gap['beyond_spread'] else 'no'}"
                     + f" | {reading['std']:.3f}, {t} | {'yes' if reading['beyond'] else 'no'} |")
    return "\n".join(lines) + "\n"


def evaluated(run_dir: Path) -> dict[str, float]:
    """Held-out success of every model a run evaluated, read from its ``eval-*.jsonl`` files
    (what a stopped run leaves): resolved over attempts the environment did not abort, as
    in the report."""
    found = {}
    named = {model_of_slug(path.name[len("eval-"):-len(".jsonl")]): path for path in run_dir.glob("eval-*.jsonl")}
    for model in sorted((m for m in named if m), key=model_order):
        path = named[model]
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        valid = [row for row in rows if row["status"] != "aborted"]
        if valid:
            found[model] = sum(bool((row.get("grade") or {}).get("resolved")) for row in valid) / len(valid)
    return found


def _report(run_dir: Path) -> Any:
    """A run's report.json, or None where it has none that can be read."""
    try:
        return json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):
        return None


def _reported(run_dir: Path) -> dict[str, float]:
    """Held-out success of every model a finished run reports, reused evaluations included
    (its eval files hold only what it evaluated itself)."""
    try:
        results = dig(_report(run_dir), "results")
        return {model: float(r["pass_rate"]) for model, r in results.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


def _finished(config: PipelineConfig, ablations: bool) -> dict[str, Any] | None:
    """The report of an earlier run of exactly this configuration (and arms), if there is one."""
    path = config.output_dir / "report.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    expected = json.loads(json.dumps(asdict(config), default=str))
    defaults = json.loads(json.dumps(asdict(PipelineConfig(output_dir=config.output_dir)), default=str))
    stored = report.get("config") or {}
    # a setting added since that run was written is read as its default (it ran without it)
    same = {**{k: v for k, v in defaults.items() if k not in stored}, **stored} == expected
    ran = report.get("ablations")  # recorded since arm runs (a bracketed name without --ablations)
    if not isinstance(ran, bool):
        ran = any("(" in model for model in report["results"])
    return report if same and ran == ablations else None


def run_study(config: PipelineConfig, seeds: Sequence[int], ablations: bool = False,
              progress: bool = True, summarize_only: bool = False) -> dict[str, Any]:
    """Every seed's pipeline (a seed already run with exactly this configuration is read back,
    so a stopped study resumes), then the summary in ``study.json`` and ``study.md``."""
    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError("seeds must be distinct and at least one")
    root = Path(config.output_dir)
    per_seed: dict[int, dict[str, float]] = {}
    for seed in seeds:
        seed_config = replace(config, seed=seed, output_dir=root / f"seed-{seed}",
                              start_from=config.start_from / f"seed-{seed}" if config.start_from else None)
        if summarize_only:  # what each seed has evaluated so far (what it reused: as that run reported it)
            found = evaluated(seed_config.output_dir)
            if found and seed_config.start_from:
                earlier = _reported(seed_config.start_from) or evaluated(seed_config.start_from)
                kept = reused_models(earlier, seed_config.continue_rl)
                earlier_report = _report(seed_config.start_from)
                final, arms, is_arm = model_names(seed_config, ablations, 1, earlier_report)
                if is_arm:
                    kept += sibling_models(earlier_report, {final, *arms.values()})
                found = {**{m: earlier[m] for m in kept if m in earlier}, **found}
            if found:
                per_seed[seed] = found
            continue
        report = _finished(seed_config, ablations) or run_pipeline(seed_config, progress, ablations)
        per_seed[seed] = {model: r["pass_rate"] for model, r in report["results"].items()}
    if not per_seed:
        raise ValueError(f"no seed under {root} has evaluated anything yet")
    summary = summarize(per_seed)
    (root / "study.json").write_text(json.dumps(summary, indent=2))
    (root / "study.md").write_text(markdown(summary))
    return summary
