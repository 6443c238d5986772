"""``orchard pipeline``: the whole recipe on the generated tasks (see orchard/pipeline/run.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from orchard.cli.common import handle_errors, out


@click.command("pipeline")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="YAML with PipelineConfig fields (backend, image, tasks, model, expert, sft, rl, ...)")
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="output directory (overrides the config's)")
@click.option("--quick", is_flag=True, help="a short version (about 5 minutes on 2 CPU cores)")
@click.option("--seed", type=int, default=None)
@click.option("--seeds", default=None, metavar="0,1,2",
              help="run every seed (into OUTPUT/seed-N) and report the seed-to-seed spread (OUTPUT/study.md)")
@click.option("--ablations", is_flag=True, help="also SFT on the other data and RL with the other group samplers")
@click.option("--summarize", is_flag=True, help="with --seeds: only summarize what each seed has evaluated so far")
@handle_errors
def pipeline(config_file: Optional[Path], output: Optional[Path], quick: bool, seed: Optional[int],
             seeds: Optional[str], ablations: bool, summarize: bool) -> None:
    """Base model, expert trajectories, credit-assignment SFT, BAR+GRPO, held-out evaluation."""
    import yaml

    from orchard.pipeline.run import QUICK, PipelineConfig, PipelineInputError, run_pipeline

    settings = dict(QUICK) if quick else {}
    if config_file:
        settings.update(yaml.safe_load(config_file.read_text()) or {})
    if output:
        settings["output_dir"] = output
    if seed is not None:
        settings["seed"] = seed
    settings.setdefault("output_dir", Path("runs/pipeline"))
    try:
        config = PipelineConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise click.UsageError(f"pipeline config: {exc}") from None
    if seeds is not None:
        from orchard.pipeline.study import run_study

        try:
            chosen = [int(part) for part in seeds.split(",")]
        except ValueError:
            raise click.BadParameter(f"seeds must be integers separated by commas, not {seeds!r}",
                                     param_hint="--seeds") from None
        if seed is not None:
            raise click.UsageError("give --seed or --seeds, not both")
        try:
            run_study(config, chosen, ablations, summarize_only=summarize)
        except PipelineInputError as exc:
            raise click.UsageError(str(exc)) from None
        out.print(f"report: {config.output_dir / 'study.md'}")
        return
    if summarize:
        raise click.UsageError("--summarize goes with --seeds")
    try:
        report = run_pipeline(config, ablations=ablations)
    except PipelineInputError as exc:
        raise click.UsageError(str(exc)) from None
    results = report["results"]
    out.print("held-out success: " + ", ".join(f"{k} {v['pass_rate']:.2f}" for k, v in results.items()))
    out.print(f"report: {config.output_dir / 'report.md'} and report.png")
