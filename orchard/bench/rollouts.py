"""``orchard bench rollouts``: the rollout engine's own overhead, with a policy that answers
instantly. Every turn still runs a real command in a real sandbox (``true`` by default; the
last one writes a file no other rollout writes, so every diff is graded), so turns/s is the
loop + SDK + agent + sandbox + grading cost per turn, the ceiling a fast model sees."""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Any, Optional

from orchard.bench.measure import percentile
from orchard.client.aio import AsyncClient
from orchard.rollout.actions import bash_block
from orchard.rollout.engine import EngineConfig, RolloutEngine
from orchard.rollout.loop import RolloutConfig
from orchard.rollout.policies.scripted import ScriptedPolicy
from orchard.tasks.generated import generate_suite


async def run(client: AsyncClient, image: str, rollouts: int, turns: int, concurrency: int, command: str,
              profile: Optional[str] = None, grade: bool = True) -> dict[str, Any]:
    [task] = generate_suite(1, seed=0, image=image)
    # The last command leaves a file no other rollout has, so every rollout's diff differs and
    # is graded on its own (the grader grades a repeated change once).
    unique = "date +%s%N > bench-stamp.txt"
    policy = ScriptedPolicy(lambda messages, turn: bash_block(command if turn < turns - 1 else unique)
                            if turn < turns else bash_block("submit"))
    config = EngineConfig(max_concurrent=concurrency, rollout=RolloutConfig(max_turns=turns + 1), grade=grade)
    async with RolloutEngine(client, policy, config) as engine:
        start = time.perf_counter()
        await engine.prepared(task).prepare()
        prepare_seconds = time.perf_counter() - start
        engine.metrics = type(engine.metrics)()  # count the rollouts only
        profiler = cProfile.Profile() if profile else None
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        samples = await engine.run([task], rollouts)
        wall = time.perf_counter() - start
        if profiler:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
            with open(profile, "w") as handle:
                handle.write(text.getvalue())
        summary = engine.metrics.summary()
    turns_done = sum(len(s.turns) for s in samples)
    grading = [s.grade.seconds for s in samples if s.grade]
    return {"graded": grade, "rollouts": rollouts, "concurrency": concurrency, "turns_per_rollout": turns + 1,
            "turns": turns_done, "wall_seconds": round(wall, 2), "turns_per_second": round(turns_done / wall, 1),
            "episode_seconds_p50": round(percentile([s.wall_seconds for s in samples], 50), 3),
            "grading_seconds_p50": round(percentile(grading, 50), 3) if grading else None,
            "prepare_seconds": round(prepare_seconds, 2), "statuses": summary["statuses"],
            "sandbox_seconds_per_rollout": summary["sandbox_seconds_per_rollout"],
            "policy_seconds_per_rollout": summary["policy_seconds_per_rollout"],
            "resolved": summary["resolved"], "failures": summary["failures"]}
