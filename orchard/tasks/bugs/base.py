"""What a bug variant is: a correct function, the one edit that breaks it, and inputs to test it.

Templates name their functions with placeholders (``@HELPER@``, ``@CALLER@``, ``@AUX@``) that
the generator fills with names drawn from the seed. Expected values are never written by
hand: :func:`run_cases` executes the correct and the broken source and compares, so a
generated test fails exactly when the bug changes the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

Outcome = tuple[str, Any]  # ("value", result) or ("raises", exception class name)


@dataclass(frozen=True)
class Case:
    """One call: a label (it becomes the test method's name) and the positional arguments."""

    label: str
    args: tuple


@dataclass(frozen=True)
class Variant:
    """One way to plant a bug of a family, with a function that calls the buggy one.

    ``helper`` is the correct source of the function the bug goes into (plus any ``@AUX@``
    function it uses); ``bug`` is ``(correct text, broken text)``, found exactly once in it.
    ``caller`` is a public function that uses ``@HELPER@``: medium and hard tasks report the
    symptom through it. ``summary`` says what goes wrong plainly; ``hint`` says it vaguely.
    """

    family: str
    name: str
    helper: str
    bug: tuple[str, str]
    caller: str
    helper_names: tuple[str, ...]
    caller_names: tuple[str, ...]
    helper_cases: Callable[[random.Random], list[Case]]
    caller_cases: Callable[[random.Random], list[Case]]
    summary: str
    hint: str
    aux_names: tuple[str, ...] = field(default=())

    @property
    def key(self) -> str:
        return f"{self.family}/{self.name}"

    def buggy_helper(self) -> str:
        correct, broken = self.bug
        if self.helper.count(correct) != 1:
            raise AssertionError(f"{self.key}: the bug's text must occur once in the helper")
        return self.helper.replace(correct, broken)


def fill(template: str, names: dict[str, str]) -> str:
    """Put the drawn names in for the placeholders (``names`` maps "HELPER" to a name)."""
    for slot, name in names.items():
        template = template.replace(f"@{slot}@", name)
    if "@" in template:
        raise AssertionError(f"unfilled placeholder in template: {template[:80]!r}")
    return template


def run_cases(source: str, function: str, cases: list[Case]) -> list[Outcome]:
    """What ``function`` (defined by ``source``) returns or raises for each case."""
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<{function}>", "exec"), namespace)  # our own templates, never task input
    outcomes: list[Outcome] = []
    for case in cases:
        try:
            outcomes.append(("value", namespace[function](*case.args)))
        except Exception as exc:  # noqa: BLE001 - the outcome is the exception's type
            outcomes.append(("raises", type(exc).__name__))
    return outcomes


def describe(outcome: Outcome) -> str:
    """An outcome as an issue would say it: the value's repr, or "raises X"."""
    kind, value = outcome
    return f"raises {value}" if kind == "raises" else repr(value)


def ints(rng: random.Random, count: int, low: int = 1, high: int = 9) -> list[int]:
    return [rng.randint(low, high) for _ in range(count)]


def pick(rng: random.Random, pool: list, count: int) -> list:
    return rng.sample(pool, count)
