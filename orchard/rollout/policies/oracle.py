"""A policy built to have a known pass rate, for checking evaluators end to end.

``NoisyOraclePolicy(tasks, p)`` knows each task's reference patch. In each rollout it first
looks around (``git status``), then with probability ``p`` applies the reference patch and
otherwise makes a plausible but wrong edit, then submits. Every step goes through the real
loop, sandbox and grader, so an evaluator measuring it must find a pass rate whose binomial
interval holds ``p``; anything else is a bug in the pipeline, not in the "model".
"""

from __future__ import annotations

import hashlib
import random
from typing import Iterable, Optional

from orchard.rollout.actions import SUBMIT_TURN, bash_block
from orchard.rollout.policies.scripted import ScriptedPolicy
from orchard.tasks import Task


def _heredoc(patch: str) -> str:
    marker = f"ORCHARD_PATCH_{hashlib.sha256(patch.encode()).hexdigest()[:12]}"  # never in the patch; reproducible
    return f"git apply --whitespace=nowarn - <<'{marker}'\n{patch.rstrip(chr(10))}\n{marker}"


WRONG_EDIT = "printf '\\n# an unrelated tweak\\n' >> \"$(git ls-files '*.py' | grep -v test | head -n 1)\""


class NoisyOraclePolicy(ScriptedPolicy):
    """Solves a task with probability ``p`` (decided once per rollout, at its first turn)."""

    name = "noisy-oracle"

    def __init__(self, tasks: Iterable[Task], p: float, seed: Optional[int] = None, **settings: object) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be within [0, 1], got {p}")
        self.p = p
        self.rng = random.Random(seed)
        self.patches = {task.problem_statement.strip(): task.reference_patch for task in tasks}
        if any(not patch.strip() for patch in self.patches.values()):
            raise ValueError("every task needs a reference_patch for the oracle")
        super().__init__(self._turn, **settings)  # type: ignore[arg-type]

    def state_dict(self) -> object:
        return self.rng.getstate()

    def load_state_dict(self, state: object) -> None:
        self.rng.setstate(state)  # type: ignore[arg-type]

    def _patch_for(self, messages: list[dict[str, str]]) -> str:
        prompt = next(m["content"] for m in messages if m["role"] == "user")
        for statement, patch in self.patches.items():
            if prompt.startswith(statement):
                return patch
        raise ValueError("the oracle was not given this task")

    def _turn(self, messages: list[dict[str, str]], turn: int) -> str:
        if turn == 0:
            return bash_block("git status --short")
        if turn == 1:
            edit = _heredoc(self._patch_for(messages)) if self.rng.random() < self.p else WRONG_EDIT
            return bash_block(edit)
        return SUBMIT_TURN
