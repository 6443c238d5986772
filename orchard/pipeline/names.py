"""What the pipeline calls its models, and which pairs of them a study compares.

The recipe's models are ``base``, ``sft`` and one ``+rl`` per round of RL on top of SFT
(``sft+rl``; ``sft+rl+rl`` after a run with ``continue_rl``, and so on). Ablation arms add
their difference in brackets: ``sft (resolved)``, ``sft+rl (dapo)``. A model's evaluation
file is ``eval-<slug>.jsonl``; ``model_of_slug`` reads the name back from it.
"""

from __future__ import annotations

import re

SAMPLERS = ("bar", "fixed", "dapo")
SFT_ARMS = ("resolved", "credit")


def rl_model(rounds: int) -> str:
    """The model ``rounds`` rounds of RL made from the SFT weights (0: the SFT model itself)."""
    return "sft" + "+rl" * rounds


def rl_rounds(name: str) -> int | None:
    """How many rounds of RL the recipe model ``name`` had (0 for ``sft``), None for any other name."""
    found = re.fullmatch(r"sft((?:\+rl)*)", name)
    return found.group(1).count("+rl") if found else None


def slug(name: str) -> str:
    """``sft+rl (dapo)`` -> ``sft-rl-dapo``: a model's name as a file name."""
    return "-".join("".join(c if c.isalnum() else " " for c in name).split())


def model_of_slug(file_slug: str) -> str | None:
    """The model whose evaluation file is ``eval-<file_slug>.jsonl`` (None: not one of the pipeline's)."""
    if file_slug == "base":
        return "base"
    found = re.fullmatch(r"sft((?:-rl)*)(?:-([a-z]+))?", file_slug)
    if not found:
        return None
    model, arm = rl_model(found.group(1).count("-rl")), found.group(2)
    if arm is None:
        return model
    allowed = SFT_ARMS if model == "sft" else SAMPLERS
    return f"{model} ({arm})" if arm in allowed else None


def model_order(name: str) -> tuple[int, int, str]:
    """Sort key: base, sft, sft+rl, ... each recipe model before its ablation arms."""
    if name == "base":
        return (-1, 0, "")
    recipe, _, arm = name.partition(" (")
    rounds = rl_rounds(recipe)
    return (99 if rounds is None else rounds, 1 if arm else 0, name)


def comparisons(models: list[str]) -> list[tuple[str, str]]:
    """(worse, better) pairs among ``models`` that the recipe claims, then the ablations' pairs:
    each RL round against the one before and against SFT, each other SFT data and each other
    group sampler against the recipe's own."""
    rounds = max((r for r in map(rl_rounds, models) if r is not None), default=0)
    pairs = [("base", "sft")]
    pairs += [(rl_model(k - 1), rl_model(k)) for k in range(1, rounds + 1)]
    pairs += [("sft", rl_model(k)) for k in range(2, rounds + 1)]
    pairs += [("sft (resolved)", "sft"), ("sft", "sft (credit)")]
    pairs += [(f"{rl_model(k)} ({s})", rl_model(k)) for k in range(1, rounds + 1) for s in SAMPLERS]
    present = set(models)
    return [pair for pair in pairs if set(pair) <= present]
