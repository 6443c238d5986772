"""Seeded SWE-like tasks that run anywhere in seconds: small Python repositories with one bug.

Each task is a package of 2-5 modules with stdlib ``unittest`` tests (the image needs only
``python3`` and ``git``). Exactly one function carries a planted bug; some tests fail because
of it (``fail_to_pass``), the others pass (``pass_to_pass``). Expected values in the tests are
computed by running the correct code at generation time, so the suite is right by
construction, and ``reference_patch`` (a ``git diff``) undoes the bug.

Bug families (``orchard.tasks.bugs``), three variants each:

- ``off_by_one``: a range or slice bound off by one (window sums, tail, pagination);
- ``comparison``: ``<`` for ``<=`` and the like (inclusive ranges, thresholds, bands);
- ``empty_input``: a wrong default or edge case (mean of nothing, blank text, even counts);
- ``accumulator_init``: an accumulator started at the wrong value (product, running max, join);
- ``swapped_args``: arguments swapped at a call site (percentages, clamping, divmod);
- ``string_case``: the wrong string method or case handling (strip, startswith, lower).

Levels:

- ``easy``: 2 modules; the tests that fail call the buggy function; the issue names it and
  shows a failing call with the expected and actual result;
- ``medium``: 3-4 modules, correct distractor functions next to the bug; the failing tests and
  the issue go through a public function that calls the buggy one (same module), with a
  failing call but no word on the cause;
- ``hard``: 4-5 modules; the public function lives in another module than the bug, and the
  issue only describes the symptom in words (no values).

Names (package, modules, functions) and numbers come from the seed, so tasks differ. A
variant's functions take one of its own three names; with ``fresh_names`` every function is
named from a pool no variant uses (``gen_repo.FRESH_NAMES``), so no name tells where the bug
is (RL's tasks in the pipeline, see ``PipelineConfig.rl_names``).

Split rule: held out by *variant*. From the seed (or ``split_seed``, when given),
``round(heldout_fraction * 18)`` variants (at least one when the fraction is positive, at
most 12) are held out, never all three of a family, so every family is trained on. Task ``i`` is held out when ``floor((i + 1) * f) > floor(i * f)``
(an even spread, ``floor(n * f)`` tasks in all), and then plants a held-out variant; train
tasks plant and even use as distractors only train variants. So held-out tasks are code shapes
the train split never shows. Families and levels cycle, so any 18 consecutive train tasks
cover every family at every level.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Optional

from orchard.tasks.bugs import FAMILIES, VARIANTS, Variant, describe
from orchard.tasks.gen_repo import TEST_COMMAND, Repo, build_repo
from orchard.tasks.task import Task

LEVELS = ("easy", "medium", "hard")
GENERATOR_VERSION = 1
SETUP = [
    "git init -q",
    "git config user.name 'Orchard Tasks'",
    "git config user.email tasks@orchard.invalid",
    "git add -A",
    "git -c commit.gpgsign=false commit -q -m 'Initial commit'",
]
_TITLES = ["`{name}` gives the wrong result", "Bug in `{name}`", "`{name}` misbehaves", "Wrong output from `{name}`"]
_CLOSINGS = ["Could you take a look?", "Please fix this; the other tests should keep passing.",
             "This blocks our release.", "Thanks!"]


def heldout_variants(seed: int, fraction: float) -> list[Variant]:
    """The variants a seed holds out: about ``fraction`` of them, keeping one of each family."""
    if not 0 <= fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1); got {fraction}")
    if fraction == 0:
        return []
    target = max(1, round(fraction * len(VARIANTS)))
    order = list(VARIANTS)
    random.Random(f"orchard-heldout:{seed}").shuffle(order)
    left = {family: sum(v.family == family for v in VARIANTS) for family in FAMILIES}
    chosen: list[Variant] = []
    for variant in order:
        if len(chosen) < target and left[variant.family] > 1:
            chosen.append(variant)
            left[variant.family] -= 1
    return chosen


def _call(repo: Repo, args: tuple) -> str:
    return f"{repo.symptom.name}({', '.join(repr(a) for a in args)})"


def problem_statement(repo: Repo, variant: Variant, level: str, rng: random.Random) -> str:
    """An issue about the bug, less explicit at each level."""
    symptom = repo.symptom
    where = f"{repo.package}.{symptom.module}"
    title = rng.choice(_TITLES).format(name=symptom.name)
    case, expected, actual = repo.example
    example = (f"```python\n>>> from {where} import {symptom.name}\n>>> {_call(repo, case.args)}\n```\n\n"
               f"gives `{describe(actual)}`, but it should give `{describe(expected)}`.")
    if level == "easy":
        body = f"`{where}.{symptom.name}` {variant.summary}. For example:\n\n{example}"
    elif level == "medium":
        body = f"I get a wrong result from `{where}.{symptom.name}`:\n\n{example}"
    else:
        body = (f"Something is off with `{where}.{symptom.name}`: {variant.hint}. "
                "I could not narrow it down further.")
    return f"{title}\n\n{body}\n\n{rng.choice(_CLOSINGS)}\n"


def generate_task(index: int, seed: int, variant: Variant, level: str, split: str, image: str,
                  distractors: list[Variant], workdir: str = "/workspace", fresh_names: bool = False) -> Task:
    """One task: ``variant``'s bug at ``level``; names and numbers drawn from (seed, index)."""
    rng = random.Random(f"orchard-task:{seed}:{index}")
    repo = build_repo(variant, level, rng, distractors, fresh_names)
    return Task(
        task_id=f"gen-{seed}-{index:05d}-{variant.family}",
        image=image,
        problem_statement=problem_statement(repo, variant, level, rng),
        workdir=workdir,
        files=repo.files,
        setup=list(SETUP),
        test_commands=[TEST_COMMAND],
        test_framework="unittest",
        fail_to_pass=repo.fail_to_pass,
        pass_to_pass=repo.pass_to_pass,
        reference_patch=repo.reference_patch,
        difficulty=level,
        tags=[variant.family, variant.name],
        split=split,
        time_limit_seconds=900.0,
        command_timeout_seconds=60.0,
        metadata={"generator": "orchard.tasks.generated", "generator_version": GENERATOR_VERSION, "seed": seed,
                  "index": index, "family": variant.family, "variant": variant.name, "bug_file": repo.bug_path,
                  "symptom": f"{repo.package}.{repo.symptom.module}.{repo.symptom.name}",
                  **({"names": "fresh"} if fresh_names else {})},
    )


def generate_suite(n: int, seed: int, image: str, heldout_fraction: float = 0.2,
                   workdir: str = "/workspace", split_seed: Optional[int] = None,
                   fresh_names: bool = False) -> list[Task]:
    """``n`` tasks, the same for the same arguments (see the module docstring for the split).
    ``split_seed``: hold out the variants of that seed instead of ``seed``'s, so suites of
    several seeds (a study's) are judged on the same code shapes. ``fresh_names``: see the
    module docstring."""
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}")
    heldout = heldout_variants(seed if split_seed is None else split_seed, heldout_fraction)
    train = [v for v in VARIANTS if v not in heldout]
    by_family = {family: [v for v in train if v.family == family] for family in FAMILIES}
    fraction = Fraction(heldout_fraction).limit_denominator(10_000)
    picker = random.Random(f"orchard-suite:{seed}")
    tasks: list[Task] = []
    counts = {"train": 0, "heldout": 0}
    for index in range(n):
        split = "heldout" if math.floor((index + 1) * fraction) > math.floor(index * fraction) else "train"
        k = counts[split]
        counts[split] += 1
        level = LEVELS[k % len(LEVELS)]
        if split == "heldout":
            variant = heldout[(k // len(LEVELS)) % len(heldout)]
            distractors = list(VARIANTS)
        else:
            variant = picker.choice(by_family[FAMILIES[(k // len(LEVELS)) % len(FAMILIES)]])
            distractors = train
        tasks.append(generate_task(index, seed, variant, level, split, image, distractors, workdir, fresh_names))
    return tasks
