"""Policies by name, for config files: ``build_policy("openai", base_url=..., model=...)``."""

from __future__ import annotations

from typing import Any, Callable

from orchard.rollout.policy import Policy


def _scripted(**settings: Any) -> Policy:
    from orchard.rollout.policies.scripted import ScriptedPolicy

    if "commands" in settings:
        return ScriptedPolicy.commands(settings.pop("commands"), **settings)
    return ScriptedPolicy(settings.pop("turns", []), **settings)


def _huggingface(**settings: Any) -> Policy:
    from orchard.rollout.policies.huggingface import HuggingFacePolicy  # imports torch: only when asked for

    if "path" not in settings:
        raise ValueError("a huggingface policy needs 'path': a directory from save_pretrained (or a hub id)")
    return HuggingFacePolicy.from_pretrained(settings.pop("path"), **settings)


def _openai(**settings: Any) -> Policy:
    from orchard.rollout.policies.openai_compat import OpenAICompatiblePolicy

    tokenizer = settings.pop("tokenizer", None)
    if isinstance(tokenizer, str):  # a path in a config file
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer)
    return OpenAICompatiblePolicy(tokenizer=tokenizer, **settings)


POLICY_KINDS: dict[str, Callable[..., Policy]] = {"scripted": _scripted, "huggingface": _huggingface, "openai": _openai}


def build_policy(kind: str, **settings: Any) -> Policy:
    """A policy of ``kind`` ("scripted": turns= or commands=; "huggingface": path=, dtype=,
    device= and the policy's settings; "openai": the policy's settings, tokenizer= may be a path)."""
    try:
        make = POLICY_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown policy kind {kind!r}: expected one of {sorted(POLICY_KINDS)}") from None
    return make(**settings)
