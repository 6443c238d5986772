"""``orchard credit``: trajectories in, a credit-assigned SFT dataset out."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import click

from orchard.cli.common import handle_errors, out


@click.command()
@click.argument("trajectories", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="SFT dataset (JSONL: messages with per-message loss_mask)")
@click.option("--teacher-url", envvar="ORCHARD_TEACHER_URL", required=True, help="OpenAI-compatible base URL (.../v1)")
@click.option("--model", "models", multiple=True, required=True, help="teacher model; repeat for an ensemble")
@click.option("--api-key", envvar="ORCHARD_TEACHER_API_KEY", default=None)
@click.option("--threshold", type=float, default=0.0, show_default=True, help="credit above which an action ascends")
@click.option("--calibrate", is_flag=True,
              help="also forecast without the outcome, fit a temperature on some tasks, score it on the others "
                   "(Brier, ECE) and, if it helps there, apply it to the values before the credits")
@click.option("--held-out", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.5,
              show_default=True, help="share of tasks the calibration is scored on (and not fitted on)")
@click.option("--calibration-report-only", is_flag=True, help="report the calibration but leave the values alone")
@click.option("--credit-resolved", is_flag=True,
              help="grade resolved trajectories too and leave out their descending actions (a wrong try they undid)")
@click.option("--concurrency", type=int, default=8, show_default=True)
@click.option("--cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="teacher answer cache (one file for all the teachers; each merges its answers in)")
@handle_errors
def credit(trajectories: Path, out_path: Path, teacher_url: str, models: tuple[str, ...], api_key: Optional[str],
           threshold: float, calibrate: bool, held_out: float, calibration_report_only: bool, credit_resolved: bool,
           concurrency: int, cache: Optional[Path]) -> None:
    """Grade TRAJECTORIES (JSONL) with LLM teachers and write the masked SFT dataset.

    Resolved trajectories are trained in full and not graded (with --calibrate they are still
    forecast without their outcome), unless --credit-resolved; failures with no ascending
    segment are dropped."""
    from orchard.train.credit import EnsembleEstimator, load_trajectories, save_jsonl
    from orchard.train.credit_pipeline import build_sft_dataset
    from orchard.train.teacher import LLMTeacher

    async def main() -> dict:
        teachers = [LLMTeacher(teacher_url, m, api_key, concurrency=concurrency, cache_path=cache) for m in models]
        try:
            result = await build_sft_dataset(load_trajectories(trajectories), EnsembleEstimator(teachers), threshold,
                                             calibrate, held_out_fraction=held_out,
                                             apply_calibration=not calibration_report_only,
                                             credit_resolved=credit_resolved)
        finally:
            for teacher in teachers:
                await teacher.close()
        save_jsonl(result.examples, out_path)
        return result.report

    out.print_json(json.dumps(asyncio.run(main())))
