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
@handle_errors
def pipeline(config_file: Optional[Path], output: Optional[Path], quick: bool, seed: Optional[int]) -> None:
    """Base model, expert trajectories, credit-assignment SFT, BAR+GRPO, held-out evaluation."""
    import yaml

    from orchard.pipeline.run import QUICK, PipelineConfig, run_pipeline

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
    report = run_pipeline(config)
    results = report["results"]
    out.print("held-out success: " + ", ".join(f"{k} {v['pass_rate']:.2f}" for k, v in results.items()))
    out.print(f"report: {config.output_dir / 'report.md'} and report.png")
