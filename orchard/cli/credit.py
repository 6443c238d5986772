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
@click.option("--calibrate", is_flag=True, help="also score outcome-blind forecasts (Brier, ECE, temperature)")
@click.option("--concurrency", type=int, default=8, show_default=True)
@click.option("--cache", type=click.Path(dir_okay=False, path_type=Path), default=None, help="teacher answer cache")
@handle_errors
def credit(trajectories: Path, out_path: Path, teacher_url: str, models: tuple[str, ...], api_key: Optional[str],
           threshold: float, calibrate: bool, concurrency: int, cache: Optional[Path]) -> None:
    """Grade TRAJECTORIES (JSONL) with LLM teachers and write the masked SFT dataset."""
    from orchard.train.credit import EnsembleEstimator, load_trajectories, save_jsonl
    from orchard.train.credit_pipeline import build_sft_dataset
    from orchard.train.teacher import LLMTeacher

    async def main() -> dict:
        teachers = [LLMTeacher(teacher_url, m, api_key, concurrency=concurrency, cache_path=cache) for m in models]
        try:
            result = await build_sft_dataset(load_trajectories(trajectories), EnsembleEstimator(teachers), threshold,
                                             calibrate)
        finally:
            for teacher in teachers:
                await teacher.close()
        save_jsonl(result.examples, out_path)
        return result.report

    out.print_json(json.dumps(asyncio.run(main())))
