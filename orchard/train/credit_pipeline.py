"""From trajectories to a credit-assigned SFT dataset, with a calibration report.

Only failed trajectories are graded with the outcome known: a resolved one is trained on
in full whatever its values say (unless ``credit_resolved``: then it is graded, and its
descending actions, a wrong try it undid, are not trained). With ``calibrate``, every trajectory (resolved ones too:
a temperature fitted on failures alone would only learn to say "fail") is also forecast
without the outcome; a temperature is fitted on some tasks' forecasts and scored on the
others' (:func:`~orchard.train.calibration.held_out_calibration`). If it lowers the
held-out Brier score it is applied to the failed trajectories' values before the credits
``c_t = V(t+1) - V(t)`` are taken. Temperature scaling is monotone, so it never flips the
sign of a credit: at ``threshold=0`` the masks stay as they were and only the stored
values change; above 0 it decides which rises are large enough (``changed_actions``).
The temperature is fitted on outcome-blind forecasts and applied to hindsight values on
the assumption that a teacher's over- or under-confidence is a property of the teacher,
shared by both kinds of answer.

Trajectories with no trained action (a failure with no ascending segment, or no steps)
are dropped and counted (``dropped_untrained``): all-zero rows cost compute and teach
nothing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

from orchard.train.calibration import TemperatureScaling, held_out_calibration
from orchard.train.credit import Trajectory, ValueEstimator, action_mask, sft_example


@dataclass
class CreditResult:
    examples: list[dict]
    report: dict


async def build_sft_dataset(trajectories: list[Trajectory], estimator: ValueEstimator, threshold: float = 0.0,
                            calibrate: bool = False, system: Optional[str] = None, held_out_fraction: float = 0.5,
                            apply_calibration: bool = True, credit_resolved: bool = False) -> CreditResult:
    """Masked SFT examples (``values``: those the mask was taken from, ``None`` for resolved
    trajectories; ``raw_values``: the teacher's, when a temperature was applied) and a report.
    ``apply_calibration=False`` keeps the calibration a report only. ``credit_resolved``:
    resolved trajectories are graded too and their descending actions left out."""
    graded = [t for t in trajectories if credit_resolved or not t.resolved]
    asks = [estimator.values(t, with_outcome=True) for t in graded]
    if calibrate:
        asks += [estimator.values(t, with_outcome=False) for t in trajectories]
    answers = await asyncio.gather(*asks)
    hindsight, forecasts = answers[:len(graded)], answers[len(graded):]
    scaling: Optional[TemperatureScaling] = None
    report: dict = {"trajectories": len(trajectories), "resolved": sum(t.resolved for t in trajectories),
                    "credit_resolved": credit_resolved}
    if calibrate:
        scaling, report["calibration"] = held_out_calibration(
            forecasts, [int(t.resolved) for t in trajectories], [t.task_id for t in trajectories], held_out_fraction)
        if not apply_calibration:
            scaling, report["calibration"]["applied"] = None, False
    values_of = {id(t): v for t, v in zip(graded, hindsight)}
    examples, trained, total, dropped, changed = [], 0, 0, 0, 0
    for trajectory in trajectories:
        raw = values_of.get(id(trajectory))
        values = scaling.apply_all(raw) if scaling is not None and raw is not None else raw
        mask = action_mask(trajectory, values, threshold, credit_resolved)
        if values is not raw:
            changed += sum(a != b for a, b in zip(mask, action_mask(trajectory, raw, threshold, credit_resolved)))
        total += len(mask)
        if not any(mask):
            dropped += 1
            continue
        trained += sum(mask)
        example = sft_example(trajectory, mask, system).to_dict()
        example.update(resolved=trajectory.resolved, values=values)
        if values is not raw:
            example["raw_values"] = raw
        examples.append(example)
    report.update(actions=total, trained_actions=trained, examples=len(examples), dropped_untrained=dropped)
    if scaling is not None:
        report["calibration"]["changed_actions"] = changed
    return CreditResult(examples, report)
