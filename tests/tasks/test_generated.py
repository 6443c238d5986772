"""Generated tasks, verified for real: each sampled task's repository is written to a temporary
directory, set up with git, its tests fail for the planted bug only, and the reference patch
applies with ``git apply`` and makes the tests pass."""

from __future__ import annotations

import os
import random
import subprocess
from collections import Counter

import pytest

from orchard.tasks import (
    LEVELS, drop_protected, generate_suite, generate_task, heldout_variants, parse_unittest, patch_files,
)
from orchard.tasks.bugs import FAMILIES, VARIANTS
from orchard.tasks.parsers import tests_passed as grade

SUITE = generate_suite(60, seed=11, image="host")


def _sample() -> list:
    """The first train task of every (family, level) and the first held-out task of every level."""
    picked: dict[tuple, object] = {}
    for task in SUITE:
        key = (task.tags[0], task.difficulty) if task.split == "train" else ("heldout", task.difficulty)
        picked.setdefault(key, task)
    return list(picked.values())


SAMPLE = _sample()


def sh(command: str, cwd, stdin: str | None = None) -> tuple[int, str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "GIT_CONFIG_NOSYSTEM": "1"}
    result = subprocess.run(command, shell=True, cwd=cwd, input=stdin, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=120)
    return result.returncode, result.stdout


def materialize(task, root):
    root.mkdir()
    for name, text in task.files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for command in task.setup:
        code, output = sh(command, root)
        assert code == 0, f"{command}: {output}"


def run_tests(task, root) -> tuple[list[str], list[int]]:
    runs = [sh(command, root) for command in task.test_commands]
    return [output for _, output in runs], [code for code, _ in runs]


def test_the_sample_covers_every_family_at_every_level():
    keys = Counter((t.tags[0], t.difficulty) for t in SAMPLE if t.split == "train")
    assert set(keys) == {(family, level) for family in FAMILIES for level in LEVELS}
    assert {t.difficulty for t in SAMPLE if t.split == "heldout"} == set(LEVELS)


@pytest.mark.parametrize("task", SAMPLE, ids=[f"{t.tags[0]}-{t.tags[1]}-{t.difficulty}-{t.split}" for t in SAMPLE])
def test_the_bug_fails_the_listed_tests_and_the_reference_patch_fixes_them(task, tmp_path):
    repo = tmp_path / "repo"
    materialize(task, repo)
    assert sh("git status --porcelain", repo) == (0, "")  # HEAD is the starting state
    assert sh("git diff HEAD", repo) == (0, "")

    outputs, codes = run_tests(task, repo)
    assert codes == [1], outputs[0]
    results = parse_unittest(outputs[0])
    assert set(results) == set(task.fail_to_pass) | set(task.pass_to_pass)  # every test is listed
    assert all(results[t] in ("FAILED", "ERROR") for t in task.fail_to_pass), results
    assert all(results[t] == "PASSED" for t in task.pass_to_pass), results
    resolved, details = grade(task, outputs, codes)
    assert not resolved and details["summary_ok"] == [False]

    (tmp_path / "fix.patch").write_text(task.reference_patch)
    code, output = sh(f"git apply {tmp_path / 'fix.patch'}", repo)
    assert code == 0, output
    code, diff = sh("git diff HEAD", repo)
    assert patch_files(diff) == [task.metadata["bug_file"]]
    assert drop_protected(diff, task.protected_paths) == (diff, [])  # the fix touches no protected file

    outputs, codes = run_tests(task, repo)
    assert codes == [0], outputs[0]
    resolved, details = grade(task, outputs, codes)
    assert resolved, details["reason"]


def test_editing_the_tests_instead_of_the_code_gets_dropped(tmp_path):
    task = SAMPLE[0]
    repo = tmp_path / "repo"
    materialize(task, repo)
    for name in task.files:
        if name.startswith("tests/test_"):
            (repo / name).write_text("")  # no tests, nothing fails
    outputs, codes = run_tests(task, repo)
    assert codes == [0] and not grade(task, outputs, codes)[0]  # listed tests are missing
    kept, dropped = drop_protected(sh("git diff HEAD", repo)[1], task.protected_paths)
    assert kept == "" and dropped and all(path.startswith("tests/") for path in dropped)


def test_every_variant_builds_at_every_level_for_many_seeds():
    for seed in range(4):
        for index, variant in enumerate(VARIANTS):
            for level in LEVELS:
                task = generate_task(index, seed, variant, level, "train", "host", VARIANTS)
                assert task.fail_to_pass and task.pass_to_pass
                assert not set(task.fail_to_pass) & set(task.pass_to_pass)
                modules = [n for n in task.files if n.count("/") == 1 and n.endswith(".py")
                           and not n.startswith("tests/") and not n.endswith("__init__.py")]
                assert len(modules) in {"easy": {2}, "medium": {3, 4}, "hard": {4, 5}}[level]


def test_problem_statements_get_less_explicit_with_level():
    by_level = {t.difficulty: t for t in SUITE if t.split == "train"}
    for level, task in by_level.items():
        symptom = task.metadata["symptom"]
        bug_module = task.metadata["bug_file"][:-3].replace("/", ".")
        assert symptom in task.problem_statement
        assert (symptom.rsplit(".", 1)[0] == bug_module) == (level != "hard")
        assert ("```python" in task.problem_statement) == (level != "hard")
    assert task.test_framework == "unittest" and task.test_commands == ["python3 -B -m unittest discover -v -s tests -t ."]


def test_same_seed_same_tasks_other_seed_other_tasks():
    again = generate_suite(60, seed=11, image="host")
    assert again == SUITE
    other = generate_suite(60, seed=12, image="host")
    assert [t.task_id for t in other] != [t.task_id for t in SUITE]
    differing = sum(a.files != b.files for a, b in zip(SUITE, other))
    assert differing >= 55  # names and numbers come from the seed
    assert len({t.problem_statement for t in SUITE}) == len(SUITE)
    assert generate_suite(5, 11, "docker://docker.io/library/python:3.11", workdir="/repo")[0].image.startswith(
        "docker://")


def test_the_heldout_split_is_non_empty_and_disjoint_by_variant():
    splits = Counter(t.split for t in SUITE)
    assert splits == {"train": 48, "heldout": 12}
    heldout_keys = {tuple(t.tags) for t in SUITE if t.split == "heldout"}
    train_keys = {tuple(t.tags) for t in SUITE if t.split == "train"}
    assert heldout_keys and not heldout_keys & train_keys
    assert {family for family, _ in train_keys} == set(FAMILIES)  # every family is trained on
    chosen = heldout_variants(11, 0.2)
    assert {(v.family, v.name) for v in chosen} == heldout_keys and len(chosen) == 4
    # train repositories never show held-out code, not even as correct distractors
    for task in (t for t in SUITE if t.split == "train"):
        text = "".join(task.files.values())
        for variant in chosen:
            assert variant.helper.splitlines()[1].strip() not in text, (task.task_id, variant.key)


def test_split_rule_edges():
    assert all(t.split == "train" for t in generate_suite(20, 1, "host", heldout_fraction=0.0))
    assert generate_suite(0, 1, "host") == []
    most = heldout_variants(1, 0.95)
    assert len(most) == 12 and all(Counter(v.family for v in most)[f] == 2 for f in FAMILIES)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError):
            generate_suite(3, 1, "host", heldout_fraction=bad)
    with pytest.raises(ValueError):
        generate_suite(-1, 1, "host")
    random_seed_suite = generate_suite(10, random.Random(4).randint(0, 10**6), "host", heldout_fraction=0.5)
    assert Counter(t.split for t in random_seed_suite) == {"train": 5, "heldout": 5}


def test_a_split_seed_holds_out_the_same_variants_for_every_seed():
    """A study over seeds judges each on the same code shapes; the tasks themselves stay the seed's."""
    shared = {seed: generate_suite(40, seed, "host", heldout_fraction=0.25, split_seed=7) for seed in (1, 2)}
    wanted = {(v.family, v.name) for v in heldout_variants(7, 0.25)}
    for seed, suite in shared.items():
        assert {tuple(t.tags) for t in suite if t.split == "heldout"} == wanted
        assert not wanted & {tuple(t.tags) for t in suite if t.split == "train"}
    assert [t.files for t in shared[1]] != [t.files for t in shared[2]]  # names and numbers are the seed's
    assert {(v.family, v.name) for v in heldout_variants(1, 0.25)} != wanted  # so the split did move
    own = generate_suite(40, 1, "host", heldout_fraction=0.25)
    assert generate_suite(40, 1, "host", heldout_fraction=0.25, split_seed=1) == own  # its own seed: unchanged


def _function_names(task) -> set[str]:
    from orchard.pipeline.choice import functions

    return {name for path, source in task.files.items()
            if path.endswith(".py") and not path.startswith("tests/") for name in functions(source)}


def test_fresh_names_name_no_function_as_any_variant_does_and_the_tasks_still_work(tmp_path):
    from orchard.tasks.gen_repo import FRESH_NAMES

    own = {n for v in VARIANTS for n in (*v.helper_names, *v.caller_names, *v.aux_names)}
    assert len(set(FRESH_NAMES)) == len(FRESH_NAMES) >= 100 and not set(FRESH_NAMES) & own
    assert all(name.isidentifier() for name in FRESH_NAMES)
    fresh = generate_suite(60, seed=11, image="host", fresh_names=True)
    assert [(t.task_id, t.split, t.tags) for t in fresh] == [(t.task_id, t.split, t.tags) for t in SUITE]
    for task in fresh:
        names = {n.lstrip("_") for n in _function_names(task)}
        assert names <= set(FRESH_NAMES) | {f"{n}_{k}" for n in FRESH_NAMES for k in range(2, 4)}, names
        assert task.metadata["names"] == "fresh" and task.metadata["symptom"].rsplit(".", 1)[1] in names
    # the suite's own names are untouched by the option (its tasks are what earlier runs reuse)
    assert all("names" not in t.metadata for t in SUITE)
    assert all(_function_names(t) & own for t in SUITE)
    # a fresh-named task is a working task: the bug fails its tests, the reference patch fixes it
    by_level = {t.difficulty: t for t in fresh if t.split == "train"}
    for level, task in by_level.items():
        (tmp_path / level).mkdir()
        test_the_bug_fails_the_listed_tests_and_the_reference_patch_fixes_them(task, tmp_path / level)


def test_every_variant_builds_with_fresh_names_at_every_level():
    for index, variant in enumerate(VARIANTS):
        for level in LEVELS:
            task = generate_task(index, 3, variant, level, "train", "host", VARIANTS, fresh_names=True)
            assert task.fail_to_pass and task.pass_to_pass and not set(task.fail_to_pass) & set(task.pass_to_pass)
