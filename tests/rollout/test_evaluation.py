"""pass@k, reports and ``orchard eval`` end to end on generated tasks."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import yaml
from click.testing import CliRunner

from orchard.cli.main import cli
from orchard.rollout.evaluation import markdown, pass_at_k, summarize, wilson_interval
from orchard.rollout.sample import Grade, RolloutSample, RolloutStatus


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    outcomes = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in draw) for draw in draws) / len(draws)


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (8, 1, 4), (8, 7, 2), (6, 0, 6)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="at least 5 attempts"):
        pass_at_k(3, 1, 5)


def test_wilson_interval_brackets_the_rate():
    low, high = wilson_interval(30, 100)
    assert low < 0.3 < high and 0.2 < low and high < 0.4
    assert wilson_interval(0, 0) == (0.0, 1.0)


def _sample(task: str, status: RolloutStatus, resolved: bool = False) -> RolloutSample:
    grade = Grade(resolved) if status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED) else None
    return RolloutSample(task, 0, status, reward=(1.0 if resolved else -1.0) if grade else None, grade=grade)


def test_summaries_leave_aborted_attempts_out_and_say_so():
    samples = [_sample("a", RolloutStatus.COMPLETED, True), _sample("a", RolloutStatus.COMPLETED),
               _sample("a", RolloutStatus.ABORTED), _sample("b", RolloutStatus.TIMED_OUT),
               _sample("b", RolloutStatus.TRUNCATED, True)]
    report = summarize(samples, ks=(1, 2, 3))
    assert report["attempts"] == 4 and report["resolved"] == 2 and report["statuses"]["aborted"] == 1
    assert list(report["pass_at_k"]) == ["pass@1", "pass@2"], "pass@3 needs 3 attempts of every task"
    assert report["pass_at_k"]["pass@1"] == pytest.approx(0.5)
    text = markdown(report)
    assert "| a | 2 | 1 |" in text and "pass@2" in text


def test_orchard_eval_measures_the_rate_a_noisy_oracle_was_built_with(tmp_path, kit_image, orchard_backend_settings):
    """The oracle solves with probability 0.6, one draw per rollout from a seeded generator,
    so the number of successes is known in advance: the whole pipeline (prepare, fork, act,
    diff, grade) must report exactly that, and 0.6 must lie in the reported interval."""
    runner = CliRunner()
    tasks_file = tmp_path / "tasks.jsonl"
    made = runner.invoke(cli, ["tasks", "generate", "--n", "8", "--seed", "5", "--image", kit_image,
                               "--out", str(tasks_file)])
    assert made.exit_code == 0, made.output
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"backend": {"name": "local", "settings": orchard_backend_settings["local"]},
                                      "policy": {"kind": "oracle", "p": 0.6, "seed": 17}, "k": [1, 5]}))
    result = runner.invoke(cli, ["eval", str(tasks_file), "--config", str(config), "--attempts", "5",
                                 "--concurrency", "8", "--no-progress", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    draws = random.Random(17)
    expected = sum(draws.random() < 0.6 for _ in range(40))
    assert report["attempts"] == 40 and report["statuses"] == {"completed": 40}
    assert report["resolved"] == expected, "every success the oracle drew, and only those, was graded resolved"
    low, high = report["pass_rate_95"]
    assert low <= 0.6 <= high
    assert set(report["pass_at_k"]) == {"pass@1", "pass@5"}
    assert len((tmp_path / "out" / "samples.jsonl").read_text().splitlines()) == 40
    assert "| task | attempts | resolved |" in (tmp_path / "out" / "report.md").read_text()


def test_orchard_eval_names_bad_input(tmp_path):
    runner = CliRunner()
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text('{"task_id": "x"}\n')
    bad = runner.invoke(cli, ["eval", str(tasks_file), "--policy", "oracle"])
    assert bad.exit_code != 0 and "tasks.jsonl:1" in bad.output and "problem_statement" in bad.output
    good = tmp_path / "good.jsonl"
    assert runner.invoke(cli, ["tasks", "generate", "--n", "1", "--out", str(good)]).exit_code == 0
    unnamed = runner.invoke(cli, ["eval", str(good)])
    assert unnamed.exit_code != 0 and "--policy" in unnamed.output
    unknown = runner.invoke(cli, ["eval", str(good), "--policy", "telepathy"])
    assert unknown.exit_code != 0 and "telepathy" in unknown.output
    empty = runner.invoke(cli, ["eval", str(good), "--policy", "oracle", "--split", "nope"])
    assert empty.exit_code != 0 and "split 'nope'" in empty.output
