"""slime's ``--rollout-function-path``: multi-turn agent rollouts in Orchard sandboxes, grouped by BAR.

slime calls ``generate_rollout(args, rollout_id, data_source, evaluation=False)`` once per
rollout step (``slime/ray/rollout.py``). ``data_source.get_samples(--rollout-batch-size)``
hands out groups of ``--n-samples-per-prompt`` copies of each prompt, with ``group_index``
and ``index`` set; each prompt's row carries its Orchard task in ``metadata.orchard_task``
(:func:`prompt_rows` writes such rows). Per prompt, BAR draws rollouts from forks of the
task's prepared state, stride by stride up to N_max, generating through SGLang's
``/generate``, and selects a group of G = ``--n-samples-per-prompt``; the group's samples
are filled in place.

slime's batch is fixed: G samples per prompt (its DP schedule counts on
``rollout_batch_size * n_samples_per_prompt``). A BAR group can hold fewer valid rollouts
than G (its fallback when the budget ran out with aborted or timed-out rollouts in the
pool), so the missing slots become zero-weight samples (``remove_sample``: mask 0, reward
0), and slime must normalize rewards with :func:`~orchard.integrations.slime.rewards.reward_post_process`
(``--custom-reward-post-process-path``), which leaves them out of their group's statistics
exactly as the standalone trainer does; :func:`check_args` refuses to run otherwise.
With ``evaluation=True`` it evaluates the settings' ``eval_tasks`` instead (:func:`evaluate`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional

from orchard.integrations.slime.runtime import SlimeRuntime, runtime
from orchard.integrations.slime.samples import fill_sample, sample_class
from orchard.rollout.engine import gather_all
from orchard.rollout.sample import RolloutStatus
from orchard.tasks import Task, load_tasks
from orchard.train.bar import Selection

POST_PROCESS = "orchard.integrations.slime.reward_post_process"
TASK_KEY = "orchard_task"


def check_args(args: Any) -> None:
    """Refuse slime settings under which uneven BAR groups would be normalized wrongly."""
    normalizes = getattr(args, "rewards_normalization", True) and getattr(args, "advantage_estimator", "grpo") in (
        "grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
    post = getattr(args, "custom_reward_post_process_path", None)
    if normalizes and post != POST_PROCESS:
        raise ValueError(f"BAR groups may hold fewer than G valid samples: run slime with "
                         f"--custom-reward-post-process-path {POST_PROCESS} (it is {post!r})")
    if getattr(args, "partial_rollout", False):
        raise ValueError("--partial-rollout does not apply: an agent rollout cannot resume in a deleted sandbox")


def task_of(sample: Any) -> Task:
    """The Orchard task a slime prompt sample carries in ``metadata.orchard_task``."""
    data = (sample.metadata or {}).get(TASK_KEY)
    if data is None:
        raise ValueError(f"prompt sample {sample.index} has no metadata.{TASK_KEY}: write the prompt data with "
                         "orchard.integrations.slime.prompt_rows")
    return Task.model_validate(json.loads(data) if isinstance(data, str) else data)


def prompt_rows(tasks: Iterable[Task]) -> list[dict[str, Any]]:
    """slime prompt-data rows (``--input-key prompt --metadata-key metadata``), one per task."""
    return [{"prompt": task.problem_statement, "metadata": {TASK_KEY: task.model_dump(mode="json")}}
            for task in tasks]


def write_prompt_data(tasks: Iterable[Task], path: Path) -> Path:
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(tasks)))
    return Path(path)


def fill_group(group: list[Any], selection: Selection, prompt_tokens: list[int], pad_id: int) -> list[Any]:
    """The slime samples of one prompt, filled from BAR's selection (slots past it: zero-weight)."""
    for slot, sample in enumerate(group):
        rollout = selection.group[slot] if slot < len(selection.group) else None
        payload = rollout.payload if rollout is not None else None
        fill_sample(sample, payload, rollout is not None and rollout.valid, prompt_tokens, pad_id)
        sample.metadata["orchard"].update(rollouts_spent=selection.rollouts_spent, fallback=selection.fallback)
    return group


async def _group(rt: SlimeRuntime, group: list[Any]) -> tuple[list[Any], Selection]:
    task = task_of(group[0])
    try:
        selection = await rt.select(task, len(group))
    finally:
        await rt.engine.release(task)
    return fill_group(group, selection, rt.prompt_tokens(task), rt.pad_id), selection


def metrics(selections: list[Selection]) -> dict[str, float]:
    """BAR's cost and balance for slime's logger."""
    n = max(len(selections), 1)
    pool = [r for s in selections for r in s.pool]
    return {"orchard/rollouts_per_prompt": len(pool) / n,
            "orchard/fallback_rate": sum(s.fallback is not None for s in selections) / n,
            "orchard/informative_groups": sum(s.informative for s in selections) / n,
            "orchard/success_rate": sum(r.positive for r in pool) / max(sum(r.valid for r in pool), 1),
            "orchard/invalid_rollouts": float(sum(not r.valid for r in pool))}


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout function (see the module docstring)."""
    rt = runtime(args)
    if evaluation:
        return evaluate(rt, args, rollout_id)
    check_args(args)
    groups = data_source.get_samples(args.rollout_batch_size)

    async def everything() -> list[tuple[list[Any], Selection]]:
        return await gather_all([_group(rt, group) for group in groups])  # cancelled: every sandbox deleted first

    done = rt.call(everything())
    return train_output([g for g, _ in done], metrics([s for _, s in done]))


def train_output(groups: list[list[Any]], values: Optional[dict[str, float]] = None) -> Any:
    """slime's ``RolloutFnTrainOutput``; a plain list of groups (which slime also takes) without slime."""
    try:
        from slime.rollout.base_types import RolloutFnTrainOutput
    except ImportError:  # the samples exist already (a stand-in's): slime's loop takes a plain list too
        return groups
    return RolloutFnTrainOutput(samples=groups, metrics=values)


def evaluate(rt: SlimeRuntime, args: Any, rollout_id: int) -> Any:
    """``evaluation=True``: the settings' ``eval_tasks``, ``eval_attempts`` each, through the same
    engine, as slime logs them (``{name: {rewards, truncated, samples}}``). As ``orchard eval``
    counts them, aborted rollouts are left out and timed-out ones are failures (-1)."""
    if not rt.settings.eval_tasks:
        raise ValueError("evaluation=True needs eval_tasks (an Orchard tasks JSONL) in the Orchard slime settings")
    tasks = load_tasks(Path(rt.settings.eval_tasks))
    rollouts = rt.call(rt.engine.run(tasks, attempts=rt.settings.eval_attempts))
    kept = [r for r in rollouts if r.status != RolloutStatus.ABORTED]
    cls = sample_class()
    samples = []
    for index, rollout in enumerate(kept):
        sample = cls(index=index)
        fill_sample(sample, rollout, rollout.reward is not None, [], rt.pad_id)
        sample.reward = rollout.reward if rollout.reward is not None else -1.0
        samples.append(sample)
    data = {"orchard": {"rewards": [s.reward for s in samples],
                        "truncated": [r.status == RolloutStatus.TRUNCATED for r in kept], "samples": samples}}
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput
    except ImportError:
        return data
    return RolloutFnEvalOutput(data=data, metrics={"orchard/eval_aborted": float(len(rollouts) - len(kept))})
