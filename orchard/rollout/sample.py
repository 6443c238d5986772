"""One rollout as trainers and evaluators see it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Optional

from orchard.train.bar import Outcome, Rollout


class RolloutStatus(str, Enum):
    """How an episode ended. ``aborted`` (the sandbox was lost, the environment failed) is
    never a failure of the policy: it earns no reward, never -1."""

    COMPLETED = "completed"  # the agent submitted
    TRUNCATED = "truncated"  # out of turns or tokens
    TIMED_OUT = "timed_out"  # out of wall-clock time
    ABORTED = "aborted"  # the environment failed (sandbox lost, setup failed, agent unreachable)


_OUTCOMES = {RolloutStatus.COMPLETED: Outcome.COMPLETED, RolloutStatus.TRUNCATED: Outcome.TRUNCATED,
             RolloutStatus.TIMED_OUT: Outcome.TIMED_OUT, RolloutStatus.ABORTED: Outcome.ABORTED}


@dataclass
class Turn:
    """One assistant turn and what the sandbox answered."""

    text: str
    action: str  # bash | submit | invalid
    command: str = ""
    exit_code: Optional[int] = None
    observation: str = ""
    policy_seconds: float = 0.0
    sandbox_seconds: float = 0.0


@dataclass
class Grade:
    """What grading found: ``resolved`` decides the reward (+1 / -1)."""

    resolved: bool
    detail: str = ""
    tests: dict[str, str] = field(default_factory=dict)  # test id -> PASSED | FAILED | ...
    dropped_paths: list[str] = field(default_factory=list)  # protected paths that made the diff refused
    seconds: float = 0.0
    cached: bool = False  # the same change was graded before for this task


@dataclass
class RolloutSample:
    """A finished episode: the conversation, its tokens for training, and its outcome.

    ``tokens``/``logprobs``/``loss_mask`` cover the whole sequence (empty for text-only
    policies); ``loss_mask`` is 1 exactly on tokens the policy sampled, so observations and
    prompts are never trained on. ``reward`` is None when the rollout was aborted."""

    task_id: str
    attempt: int
    status: RolloutStatus
    reward: Optional[float] = None
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    prompt_length: int = 0
    diff: str = ""
    grade: Optional[Grade] = None
    error: Optional[str] = None  # why it was aborted / timed out / truncated
    error_type: Optional[str] = None  # the environment error's type, e.g. SandboxLost
    policy_seconds: float = 0.0
    sandbox_seconds: float = 0.0
    wall_seconds: float = 0.0
    sandbox_id: Optional[str] = None

    @property
    def resolved(self) -> bool:
        return self.grade is not None and self.grade.resolved

    def to_bar(self) -> Rollout:
        """The sample as BAR's group selection reads it (payload: the sample itself)."""
        return Rollout(reward=self.reward, outcome=_OUTCOMES[self.status], payload=self)

    def to_dict(self, tokens: bool = True) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        if not tokens:
            for key in ("tokens", "logprobs", "loss_mask"):
                data.pop(key)
        return data
