"""Policies the rollout loop can act with: scripted (tests), a Hugging Face model in process,
an OpenAI-compatible server (vLLM, SGLang, hosted APIs)."""

from __future__ import annotations

from typing import Any

from orchard.rollout.policies.errors import PolicyError, PolicyResponseError, PolicyServerError, TokenContextMismatch
from orchard.rollout.policies.factory import POLICY_KINDS, build_policy
from orchard.rollout.policies.openai_compat import OpenAICompatiblePolicy
from orchard.rollout.policies.scripted import SUBMIT, ScriptedPolicy, bash_block

__all__ = ["HuggingFacePolicy", "OpenAICompatiblePolicy", "POLICY_KINDS", "PolicyError", "PolicyResponseError",
           "PolicyServerError", "SUBMIT", "ScriptedPolicy", "TokenContextMismatch", "bash_block", "build_policy"]


def __getattr__(name: str) -> Any:
    if name == "HuggingFacePolicy":  # imports torch, so only when asked for
        from orchard.rollout.policies.huggingface import HuggingFacePolicy

        return HuggingFacePolicy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
