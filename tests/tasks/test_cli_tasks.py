"""``orchard tasks generate | convert | show``."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from orchard.cli.tasks import tasks
from orchard.tasks import generate_suite, load_tasks

FIXTURES = Path(__file__).parent / "fixtures"


def invoke(*args: str):
    """Run the group on its own, so these tests do not depend on every other command importing."""
    assert args[0] == "tasks"
    return CliRunner().invoke(tasks, list(args[1:]), catch_exceptions=False)


def flat(text: str) -> str:
    """Output without the line breaks rich adds at the console width."""
    return " ".join(text.split())


def test_generate_writes_the_same_suite_as_the_library(tmp_path):
    out = tmp_path / "suite.jsonl"
    image = "docker://docker.io/library/python:3.11"
    result = invoke("tasks", "generate", "--n", "10", "--seed", "4", "--image", image, "--out", str(out),
                    "--heldout-fraction", "0.3")
    assert result.exit_code == 0, result.output
    assert "wrote 10 tasks" in result.output and "3 heldout" in result.output and "7 train" in result.output
    assert load_tasks(out) == generate_suite(10, 4, image, heldout_fraction=0.3)
    shared = tmp_path / "shared.jsonl"  # a study's split: another seed's held-out variants
    result = invoke("tasks", "generate", "--n", "10", "--seed", "4", "--image", image, "--out", str(shared),
                    "--heldout-fraction", "0.3", "--split-seed", "9")
    assert result.exit_code == 0, result.output
    assert load_tasks(shared) == generate_suite(10, 4, image, heldout_fraction=0.3, split_seed=9) != load_tasks(out)


def test_show_lists_id_family_difficulty_split(tmp_path):
    out = tmp_path / "suite.jsonl"
    invoke("tasks", "generate", "--n", "5", "--seed", "2", "--out", str(out))
    result = invoke("tasks", "show", str(out))
    assert result.exit_code == 0
    for word in ("family", "difficulty", "split", "off_by_one", "easy", "medium", "hard", "heldout", "train"):
        assert word in result.output
    rows = json.loads(invoke("tasks", "show", "--json", str(out)).output)
    assert [(r["family"], r["difficulty"], r["split"]) for r in rows] == [
        ("off_by_one", "easy", "train"), ("off_by_one", "medium", "train"), ("off_by_one", "hard", "train"),
        ("comparison", "easy", "train"), (rows[4]["family"], "easy", "heldout")]
    assert rows[0]["task_id"] == "gen-2-00000-off_by_one" and rows[0]["fail_to_pass"] >= 1


def test_convert_swebench_then_show(tmp_path):
    out = tmp_path / "swe.jsonl"
    result = invoke("tasks", "convert", str(FIXTURES / "swebench_sympy.jsonl"), "--out", str(out),
                    "--skip-unsupported")
    assert result.exit_code == 0 and "wrote 1 tasks" in result.output
    rows = json.loads(invoke("tasks", "show", "--json", str(out)).output)
    assert rows[0]["task_id"] == "astropy__astropy-12907" and rows[0]["family"] == "astropy/astropy"
    assert rows[0]["split"] == "test"
    result = invoke("tasks", "convert", str(FIXTURES / "swerebench.jsonl"), "--out", str(out), "--source",
                    "swe-rebench", "--split", "rl")
    assert result.exit_code == 0 and {t.split for t in load_tasks(out)} == {"rl"}


def test_bad_files_and_options_fail_clearly(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "x", "image": "host", "problem_statement": "p", "test_commands": []}\n')
    result = invoke("tasks", "show", str(bad))
    assert result.exit_code == 2 and "TaskFileError" in result.output
    assert "bad.jsonl:1: test_commands: List should have at least 1 item" in flat(result.output)
    result = invoke("tasks", "convert", str(FIXTURES / "swebench_sympy.jsonl"), "--out", str(tmp_path / "o.jsonl"))
    assert result.exit_code == 2 and "sympy__sympy-20590: unsupported" in flat(result.output)
    result = invoke("tasks", "generate", "--n", "3", "--out", str(tmp_path / "x.jsonl"), "--heldout-fraction", "1")
    assert result.exit_code == 2 and "heldout-fraction" in result.output


def test_the_group_is_registered_in_the_orchard_command():
    from orchard.cli.main import cli

    assert cli.commands["tasks"] is tasks
