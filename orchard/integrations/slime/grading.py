"""slime's own rollout loop with Orchard's rollouts and tamper-proof grading.

``generate`` (``--custom-generate-function-path``): for slime's loop (fixed groups, no BAR,
its dynamic-sampling filters), one multi-turn episode of the sample's task in a fork of its
prepared state fills the sample's tokens, mask and log-probs and leaves ``reward`` None, so
that slime calls ``--custom-rm-path``. slime's ``sampling_params`` are not used: the
per-turn budget is ``--rollout-max-response-len``, as in the rollout function.

``grade_reward`` (``--custom-rm-path``): the diff the rollout left (``metadata.orchard.diff``,
taken from its sandbox as untrusted bytes) is graded in a fresh fork of the task's prepared
state, never in the rollout's sandbox: deleting or neutering the tests there earns -1. The
engine graded it once already; verdicts are cached per task and diff, so this costs nothing
more for a diff it has seen.
"""

from __future__ import annotations

import asyncio
from typing import Any

from orchard.integrations.slime.rollout import task_of
from orchard.integrations.slime.runtime import runtime
from orchard.integrations.slime.samples import fill_sample
from orchard.rollout.grading import RefusedDiff, grade


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """One agent rollout of the sample's task; its reward is left to ``grade_reward``."""
    rt = runtime(args)
    task = task_of(sample)
    rollout = await rt.run(rt.engine.rollout(task))
    valid = rollout.to_bar().valid
    fill_sample(sample, rollout, valid, rt.prompt_tokens(task), rt.pad_id)
    if valid:
        sample.reward = None  # slime's reward function decides
    return sample


async def grade_reward(args: Any, sample: Any, **kwargs: Any) -> Any:
    """+1 if the rollout's diff resolves its task in a fresh fork, else -1 (a list: one each)."""
    if isinstance(sample, list):  # --group-rm hands the whole group
        return list(await asyncio.gather(*(grade_reward(args, s, **kwargs) for s in sample)))
    info = (sample.metadata or {}).get("orchard", {})
    if "diff" not in info:
        raise ValueError(f"sample {sample.index} carries no metadata.orchard.diff: it was not produced by "
                         "Orchard's rollout or generate function")
    if info.get("valid") is False:  # timed out or aborted: no verdict, and the post-process leaves it out
        return 0.0
    rt = runtime(args)
    task = task_of(sample)
    diff = RefusedDiff(info["diff_refused"]) if info.get("diff_refused") else info["diff"]
    verdict = await rt.run(grade(rt.engine.prepared(task), diff))
    info["grade"] = {"resolved": verdict.resolved, "detail": verdict.detail, "dropped_paths": verdict.dropped_paths}
    return 1.0 if verdict.resolved else -1.0
