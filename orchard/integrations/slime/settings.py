"""What the slime functions need besides slime's own ``args``: where sandboxes live and BAR.

slime calls ``--rollout-function-path`` and ``--custom-rm-path`` with its parsed arguments
only, and its parser rejects flags it does not know, so Orchard's settings come from a
YAML file named by ``ORCHARD_SLIME_CONFIG`` (or :func:`~orchard.integrations.slime.runtime.configure`
in process). Sampling settings come from slime's flags (``--rollout-temperature``,
``--rollout-top-p``, ``--rollout-max-response-len`` as the per-turn budget,
``--rollout-max-context-len`` as the whole sequence's), the group size from
``--n-samples-per-prompt``, the router from ``--sglang-router-ip``/``--sglang-router-port``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from orchard.rollout.engine import EngineConfig
from orchard.rollout.loop import RolloutConfig
from orchard.train.bar import Band, BARConfig

CONFIG_ENV = "ORCHARD_SLIME_CONFIG"


@dataclass
class SlimeSettings:
    backend: str = field(default="local", metadata={"help": "sandbox backend (in process) when no server_url"})
    backend_settings: dict[str, Any] = field(default_factory=dict, metadata={"help": "the backend's settings"})
    server_url: Optional[str] = field(default=None, metadata={"help": "an Orchard server instead of a backend"})
    api_key: Optional[str] = field(default=None, metadata={"help": "the Orchard server's API key"})
    router_url: Optional[str] = field(default=None, metadata={
        "help": "SGLang router (default: http://<--sglang-router-ip>:<--sglang-router-port>)"})
    max_concurrent: int = field(default=64, metadata={"help": "rollout sandboxes alive at once"})
    rollout: dict[str, Any] = field(default_factory=dict, metadata={"help": "RolloutConfig fields (turns, limits)"})
    sandbox: dict[str, Any] = field(default_factory=dict, metadata={"help": "create options of every sandbox"})
    max_rollouts: int = field(default=32, metadata={"help": "BAR's N_max per prompt and rollout step"})
    stride: int = field(default=8, metadata={"help": "BAR's rollouts per stride"})
    rho_min: float = field(default=0.25, metadata={"help": "BAR's band: least share of successes"})
    rho_max: float = field(default=0.75, metadata={"help": "BAR's band: largest share of successes"})
    adaptive_band: bool = field(default=True, metadata={"help": "plan each prompt's band (AdaptiveBand)"})
    eval_tasks: Optional[str] = field(default=None, metadata={"help": "Orchard tasks JSONL for evaluation=True"})
    eval_attempts: int = field(default=1, metadata={"help": "attempts per evaluation task"})
    sft_max_length: Optional[int] = field(default=None, metadata={
        "help": "SFT: tokens per example (default: --seq-length)"})

    @classmethod
    def load(cls, path: Optional[str] = None) -> "SlimeSettings":
        """From ``path``, else the file ``$ORCHARD_SLIME_CONFIG`` names, else the defaults."""
        path = path or os.environ.get(CONFIG_ENV)
        if not path:
            return cls()
        data = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; expected some of {sorted(known)}")
        return cls(**data)

    def band(self) -> Band:
        return Band(self.rho_min, self.rho_max)

    def bar(self, group_size: int) -> BARConfig:
        """BAR for slime's group size (``--n-samples-per-prompt``); N_max is at least G."""
        return BARConfig(group_size=group_size, max_rollouts=max(self.max_rollouts, group_size), stride=self.stride,
                         band=self.band())

    def engine(self, args: Any) -> EngineConfig:
        rollout = dict(self.rollout)
        if getattr(args, "rollout_max_response_len", None):
            rollout.setdefault("max_tokens_per_turn", args.rollout_max_response_len)
        if getattr(args, "rollout_max_context_len", None):
            rollout.setdefault("max_total_tokens", args.rollout_max_context_len)
        return EngineConfig(max_concurrent=self.max_concurrent, rollout=RolloutConfig(**rollout),
                            sandbox=dict(self.sandbox))

    def router(self, args: Any) -> str:
        if self.router_url:
            return self.router_url
        host, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
        if not host or not port:
            raise ValueError("no SGLang router: slime's --sglang-router-ip/--sglang-router-port are unset "
                             f"and {CONFIG_ENV} names no router_url")
        return f"http://{host}:{port}"
