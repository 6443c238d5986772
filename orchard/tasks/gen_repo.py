"""Lay out one generated repository: a package of small modules with one planted bug, unittest
files whose expected values come from running the correct code, and the patch that fixes it."""

from __future__ import annotations

import builtins
import difflib
import random
from dataclasses import dataclass, field
from typing import Optional

from orchard.tasks.bugs import Case, Outcome, Variant, fill, run_cases

# -B: no bytecode cache, which trusts a .pyc while the source keeps its size and its mtime in whole
# seconds: a same-size edit within a second of a test run (a tried candidate undone for another)
# would be tested as the old code.
TEST_COMMAND = "python3 -B -m unittest discover -v -s tests -t ."
PACKAGES = ["ledger", "tally", "beacon", "quarry", "harbor", "meadow", "lantern", "orchid", "compass", "pebble",
            "summit", "thimble", "willow", "cobalt", "juniper", "saffron", "granite", "kestrel", "marlin", "nimbus"]
MODULES = ["core", "util", "stats", "text", "series", "records", "calc", "helpers", "formatting", "metrics",
           "parsing", "reports", "tools", "grading", "timing", "convert", "summary", "checks"]
LEVEL_MODULES = {"easy": (2, 2), "medium": (3, 4), "hard": (4, 5)}
# Fresh names: verb_noun pairs no variant uses (checked in the tests), for tasks whose function
# names must tell nothing: a training variant's own three names let a policy find the bug by a
# name it has seen instead of by reading the call path, which is all a held-out variant allows.
_FRESH_VERBS = ("scan", "fold", "pick", "rank", "trim", "sift", "weigh", "probe", "stack", "blend",
                "gauge", "track", "chart", "sweep", "tag", "mend", "pack", "sort", "bind", "pool")
_FRESH_NOUNS = ("batch", "spans", "marks", "cells", "ticks", "bins", "runs", "notes", "lots", "units",
                "slots", "tiles", "keys", "cards", "logs", "rows", "grid", "queue", "trail", "stock")
FRESH_NAMES = tuple(f"{verb}_{noun}" for verb in _FRESH_VERBS for noun in _FRESH_NOUNS)


class NameBook:
    """Hands out function names that are unique within one repository: a variant's own names,
    or with ``fresh`` names from ``FRESH_NAMES`` whatever the variant."""

    def __init__(self, rng: random.Random, fresh: bool = False) -> None:
        self.rng, self.used, self.fresh = rng, set(), fresh

    def take(self, pool: tuple[str, ...], private: bool = False) -> str:
        options = list(pool)
        self.rng.shuffle(options)
        for name in options + [f"{pool[0]}_{n}" for n in range(2, 100)]:
            name = "_" + name if private else name
            if name not in self.used:
                self.used.add(name)
                return name
        raise AssertionError("ran out of names")

    def names_for(self, variant: Variant) -> dict[str, str]:
        def pool(own: tuple[str, ...]) -> tuple[str, ...]:
            return FRESH_NAMES if self.fresh else own

        names = {"HELPER": self.take(pool(variant.helper_names)), "CALLER": self.take(pool(variant.caller_names))}
        if variant.aux_names:
            names["AUX"] = self.take(pool(variant.aux_names), private=True)
        return names


@dataclass
class Placed:
    """A function of a variant put into a module: the variant's helper or its caller."""

    variant: Variant
    role: str  # "helper" or "caller"
    names: dict[str, str]
    module: str

    @property
    def name(self) -> str:
        return self.names["CALLER" if self.role == "caller" else "HELPER"]

    def source(self, buggy: bool) -> str:
        if self.role == "caller":
            return fill(self.variant.caller, self.names)
        return fill(self.variant.buggy_helper() if buggy else self.variant.helper, self.names)

    def outcomes(self, cases: list[Case], buggy: bool) -> list[Outcome]:
        """Run the cases against the helper (and the caller on top of it)."""
        source = fill(self.variant.buggy_helper() if buggy else self.variant.helper, self.names)
        if self.role == "caller":
            source += "\n\n" + self.source(buggy)
        return run_cases(source, self.name, cases)


@dataclass
class Repo:
    """A generated repository in its starting (buggy) state, with what grading needs."""

    package: str
    files: dict[str, str]
    bug_path: str
    fixed_text: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    symptom: Placed  # the function the issue talks about
    example: tuple[Case, Outcome, Outcome]  # a call that shows the bug: (case, expected, actual)
    modules: list[str] = field(default_factory=list)

    @property
    def reference_patch(self) -> str:
        before, after = self.files[self.bug_path], self.fixed_text
        lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                     f"a/{self.bug_path}", f"b/{self.bug_path}")
        return f"diff --git a/{self.bug_path} b/{self.bug_path}\n" + "".join(lines)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _render_module(package: str, module: str, placed: list[Placed], bug: Placed, buggy: bool) -> str:
    """A module's text; ``buggy``: with the bug planted in ``bug`` (if it lives here)."""
    imports = [f"from .{bug.module} import {bug.name}" for p in placed
               if p.role == "caller" and p.variant is bug.variant and p.names is bug.names and p.module != bug.module]
    body = [p.source(buggy and p is bug) for p in placed]
    head = f'"""{module.capitalize()} helpers of the {package} package."""\n'
    return head + ("\n" + "\n".join(imports) + "\n" if imports else "") + "\n\n" + "\n\n".join(body)


def _test_method(function: str, case: Case, expected: Outcome, used: set[str]) -> tuple[str, str]:
    name = f"test_{case.label}"
    while name in used:
        name += "_again"
    used.add(name)
    call = f"{function}({', '.join(repr(arg) for arg in case.args)})"
    kind, value = expected
    if kind == "raises":
        if not isinstance(getattr(builtins, value, None), type):
            raise AssertionError(f"{function}: expected exception {value} is not a builtin")
        body = f"        with self.assertRaises({value}):\n            {call}\n"
    else:
        body = f"        self.assertEqual({call}, {value!r})\n"
    return name, f"    def {name}(self):\n{body}"


@dataclass
class _Layout:
    """Which function goes in which module."""

    package: str
    modules: list[str]
    helper: Placed  # carries the bug
    caller: Optional[Placed]  # medium and hard: the public function the issue talks about
    extra: list[Placed]  # correct functions of other variants
    by_module: dict[str, list[Placed]]


def _lay_out(variant: Variant, level: str, rng: random.Random, distractors: list[Variant],
             fresh_names: bool) -> _Layout:
    book = NameBook(rng, fresh_names)
    package = rng.choice(PACKAGES)
    low, high = LEVEL_MODULES[level]
    modules = rng.sample(MODULES, rng.randint(low, high))
    names = book.names_for(variant)
    helper = Placed(variant, "helper", names, modules[0])
    by_module: dict[str, list[Placed]] = {m: [] for m in modules}
    by_module[helper.module].append(helper)
    caller = None
    if level != "easy":
        caller = Placed(variant, "caller", names, modules[1] if level == "hard" else modules[0])
        by_module[caller.module].append(caller)
    pool = [v for v in distractors if v is not variant] or [variant]
    rng.shuffle(pool)
    if level == "easy":
        slots = modules[1:]
    else:  # one correct function next to the bug, one or two in every other module
        slots = [modules[0]] + [m for m in modules[1:] for _ in range(rng.randint(1, 2))]
    extra: list[Placed] = []
    for index, module in enumerate(slots):
        other = pool[index % len(pool)]
        extra.append(Placed(other, "helper", book.names_for(other), module))
        by_module[module].append(extra[-1])
    for placed in by_module.values():
        rng.shuffle(placed)
    return _Layout(package, modules, helper, caller, extra, by_module)


def build_repo(variant: Variant, level: str, rng: random.Random, distractors: list[Variant],
               fresh_names: bool = False) -> Repo:
    """The repository of one task: ``variant``'s bug at ``level``, other variants as correct code.

    Tests: the symptom function (the helper at easy, else its caller) on all its cases; at
    medium and hard also the helper on the cases the bug does not change; each distractor on
    a few cases. A test whose expected outcome differs under the bug is fail-to-pass.
    ``fresh_names``: every function named from ``FRESH_NAMES`` (see there).
    """
    layout = _lay_out(variant, level, rng, distractors, fresh_names)
    helper, caller, package = layout.helper, layout.caller, layout.package
    symptom = caller or helper
    groups: list[tuple[Placed, list[Case]]] = [(symptom, variant.caller_cases(rng) if caller
                                                 else variant.helper_cases(rng))]
    if caller:
        cases = variant.helper_cases(rng)
        same = [c for c, a, b in zip(cases, helper.outcomes(cases, False), helper.outcomes(cases, True)) if a == b]
        groups.append((helper, same))
    groups += [(p, p.variant.helper_cases(rng)[:3]) for p in layout.extra]

    classes: dict[str, list[str]] = {}
    imported: dict[str, set[str]] = {}
    f2p: list[str] = []
    p2p: list[str] = []
    example = None
    for placed, cases in groups:
        good = placed.outcomes(cases, False)
        bad = placed.outcomes(cases, True) if placed is helper or placed is caller else good
        cls, used, methods = f"Test{_camel(placed.name)}", set(), []
        for case, expected, actual in zip(cases, good, bad):
            method, text = _test_method(placed.name, case, expected, used)
            methods.append(text)
            (f2p if expected != actual else p2p).append(f"tests.test_{placed.module}.{cls}.{method}")
            if expected != actual and placed is symptom and example is None:
                example = (case, expected, actual)
        if methods:
            classes.setdefault(placed.module, []).append(f"class {cls}(unittest.TestCase):\n" + "\n".join(methods))
            imported.setdefault(placed.module, set()).add(placed.name)
    if example is None or not p2p:
        raise AssertionError(f"{variant.key}: the cases must show the bug and keep some tests passing")

    modules = layout.modules
    files: dict[str, str] = {f"{package}/__init__.py": f'"""The {package} package: {", ".join(modules)}."""\n',
                             "tests/__init__.py": "", ".gitignore": "__pycache__/\n*.pyc\n"}
    for module in modules:
        files[f"{package}/{module}.py"] = _render_module(package, module, layout.by_module[module], helper, True)
    for module, texts in classes.items():
        files[f"tests/test_{module}.py"] = (f'"""Tests of {package}.{module}."""\n\nimport unittest\n\n'
                                            f"from {package}.{module} import {', '.join(sorted(imported[module]))}"
                                            "\n\n\n" + "\n\n".join(texts) + '\n\nif __name__ == "__main__":\n'
                                            "    unittest.main()\n")
    files["README.md"] = (f"# {package}\n\nSmall utilities in the `{package}` package: "
                          f"{', '.join(f'`{m}`' for m in modules)}.\n\nRun the tests with:\n\n    {TEST_COMMAND}\n")
    fixed = _render_module(package, helper.module, layout.by_module[helper.module], helper, False)
    return Repo(package, files, f"{package}/{helper.module}.py", fixed, f2p, p2p, symptom, example, modules)
