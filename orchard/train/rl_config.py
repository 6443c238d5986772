"""Settings of the BAR+GRPO trainer (``orchard train rl --config FILE``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from orchard.train.bar import Band, BARConfig
from orchard.train.grpo import GRPOLossConfig

GroupSampler = Literal["bar", "fixed", "dapo"]


@dataclass
class RLConfig:
    output_dir: Path = field(metadata={"help": "checkpoints, metrics.jsonl, plots"})
    steps: int = field(default=150, metadata={"help": "optimizer steps (the original: up to 150)"})
    rollout_budget: int = field(default=0, metadata={
        "help": "stop once this many rollouts were drawn (0: no budget); samplers compared at equal rollouts"})
    tasks_per_step: int = field(default=16, metadata={"help": "prompts (tasks) per step: the rollout batch"})
    sampler: GroupSampler = field(default="bar", metadata={
        "help": "bar: BAR's balanced groups; fixed: G rollouts per task, all kept (the fixed-G baseline); "
                "dapo: G per task, groups without both outcomes dropped and replaced by new tasks"})
    dapo_max_batches: int = field(default=3, metadata={"help": "dapo: at most this many batches of tasks a step"})
    group_size: int = field(default=8, metadata={"help": "G: samples per task in a training group"})
    max_rollouts: int = field(default=32, metadata={"help": "BAR's N_max: rollout budget per task and step"})
    stride: int = field(default=8, metadata={"help": "BAR's rollouts per stride (run concurrently)"})
    rho_min: float = field(default=0.25, metadata={"help": "BAR's band: least share of successes in a group"})
    rho_max: float = field(default=0.75, metadata={"help": "BAR's band: largest share of successes"})
    adaptive_band: bool = field(default=True, metadata={"help": "plan each task's band from recent success rates"})
    scale_advantages: bool = field(default=True, metadata={"help": "divide by the group's std (False: Dr. GRPO)"})
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig, metadata={"help": "the GRPO objective"})
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warmup of the learning rate (Adam's first "
                                                           "steps move every weight by about the full rate)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping"})
    micro_batch_size: int = field(default=4, metadata={"help": "sequences per forward pass"})
    inner_epochs: int = field(default=1, metadata={"help": "passes over each step's samples (PPO epochs)"})
    save_every: int = field(default=0, metadata={"help": "steps between checkpoints (0: at the end)"})
    seed: int = field(default=0, metadata={"help": "task order and initialization"})

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if isinstance(self.loss, dict):
            self.loss = GRPOLossConfig(**self.loss)
        if min(self.steps, self.tasks_per_step, self.group_size, self.micro_batch_size, self.inner_epochs) < 1:
            raise ValueError("steps, tasks_per_step, group_size, micro_batch_size and inner_epochs must be >= 1")
        if self.rollout_budget < 0:
            raise ValueError("rollout_budget must be >= 0 (0: no budget)")
        if self.sampler not in ("bar", "fixed", "dapo"):
            raise ValueError(f"sampler must be bar, fixed or dapo, not {self.sampler!r}")
        self.bar()  # checks the band and the budget

    def bar(self) -> BARConfig:
        return BARConfig(group_size=self.group_size, max_rollouts=self.max_rollouts, stride=self.stride,
                         band=Band(self.rho_min, self.rho_max))
