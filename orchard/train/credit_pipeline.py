"""From trajectories to a credit-assigned SFT dataset, with a calibration report."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

from orchard.train.calibration import calibration_report
from orchard.train.credit import Trajectory, ValueEstimator, action_mask, sft_example


@dataclass
class CreditResult:
    examples: list[dict]
    report: dict


async def build_sft_dataset(trajectories: list[Trajectory], estimator: ValueEstimator, threshold: float = 0.0,
                            calibrate: bool = False, system: Optional[str] = None) -> CreditResult:
    """Values with the outcome known give the masks; with ``calibrate``, forecasts made
    without the outcome are scored against it (Brier, ECE, before/after temperature)."""
    values = await asyncio.gather(*(estimator.values(t, with_outcome=True) for t in trajectories))
    examples, trained, total = [], 0, 0
    for trajectory, v in zip(trajectories, values):
        mask = action_mask(trajectory, v, threshold)
        trained += sum(mask)
        total += len(mask)
        example = sft_example(trajectory, mask, system).to_dict()
        example.update(resolved=trajectory.resolved, values=v)
        examples.append(example)
    report: dict = {"trajectories": len(trajectories), "resolved": sum(t.resolved for t in trajectories),
                    "actions": total, "trained_actions": trained}
    if calibrate:
        forecasts = await asyncio.gather(*(estimator.values(t, with_outcome=False) for t in trajectories))
        points = [(p, int(t.resolved)) for t, f in zip(trajectories, forecasts) for p in f]
        report["calibration"] = calibration_report([p for p, _ in points], [y for _, y in points])
    return CreditResult(examples, report)
