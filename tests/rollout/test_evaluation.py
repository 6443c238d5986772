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


def test_summaries_also_count_aborted_and_timed_out_attempts_as_failures_and_say_what_is_left_out():
    """Aborted attempts leave ``pass_rate``'s n, so a run the environment mostly failed could
    look fine: ``pass_rate_all`` counts every attempt (aborted and timed out as failures), a
    warning says when more than 5% were aborted, and a pass@k some task lacks attempts for is
    named with those tasks rather than silently dropped."""
    samples = [_sample("a", RolloutStatus.COMPLETED, True), _sample("a", RolloutStatus.COMPLETED),
               _sample("a", RolloutStatus.ABORTED), _sample("b", RolloutStatus.TIMED_OUT),
               _sample("b", RolloutStatus.TRUNCATED, True), _sample("b", RolloutStatus.COMPLETED)]
    samples[2].error_type = "sandbox_lost"
    report = summarize(samples, ks=(1, 3))
    assert report["attempts"] == 5 and report["pass_rate"] == pytest.approx(2 / 5)
    assert report["attempts_all"] == 6 and report["aborted"] == 1
    assert report["pass_rate_all"] == pytest.approx(2 / 6)
    low, high = report["pass_rate_all_95"]
    assert low < 2 / 6 < high
    assert list(report["pass_at_k"]) == ["pass@1"]
    assert report["pass_at_k_left_out"] == {"pass@3": {"a": 2}}, "b has 3 valid attempts, a only 2"
    [warning] = report["warnings"]
    assert "1 of 6" in warning and "aborted" in warning and "sandbox_lost" in warning
    text = markdown(report)
    assert "0.333" in text and "pass@3" in text and "a: 2" in text and warning in text
    clean = summarize([_sample("a", RolloutStatus.COMPLETED, True)] * 19 + [_sample("a", RolloutStatus.ABORTED)])
    assert clean["warnings"] == [] and clean["pass_at_k_left_out"] == {}, "5% aborted is tolerated"


def _eval(tmp_path, *args: str, config=None, tasks=None):
    runner = CliRunner()
    tasks_file = tmp_path / "tasks.jsonl"
    if tasks is None:
        assert runner.invoke(cli, ["tasks", "generate", "--n", "1", "--out", str(tasks_file)]).exit_code == 0
    else:
        tasks_file.write_bytes(tasks)
    options = []
    if config is not None:
        (tmp_path / "eval.yaml").write_text(config)
        options = ["--config", str(tmp_path / "eval.yaml")]
    return runner.invoke(cli, ["eval", str(tasks_file), "--policy", "oracle", "--no-progress", *options, *args])


@pytest.mark.parametrize("config,args,said", [
    ("rollout: {max_turns: x}", (), "rollout.max_turns"),
    ("rollout: {bogus: 1}", (), "bogus"),
    ("- a\n- b\n", (), "mapping"),
    ("backend: [local]", (), "backend"),
    ("backend: {name: local, bogus: 1}", (), "bogus"),
    ("attempts: two", (), "attempts"),
    ("attempts: 0", (), "attempts"),
    ("k: [1, x]", (), "k"),
    ("concurrency: -2", (), "concurrency"),
    ("sandbox: {memory: lots}", (), "sandbox.memory"),
    ("sandbox: {sandbox_id: sbx-1}", (), "sandbox_id"),
    ("colour: blue", (), "colour"),
    (None, ("-k", "0"), "-k"),
    (None, ("--limit", "-1"), "--limit"),
    (None, ("--limit", "0"), "--limit"),
    (None, ("--attempts", "0"), "--attempts"),
    (None, ("--attempts", "-1"), "--attempts"),
    (None, ("--concurrency", "0"), "--concurrency"),
])
def test_orchard_eval_refuses_bad_settings_by_name(tmp_path, config, args, said):
    result = _eval(tmp_path, *args, config=config)
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit) and said in result.output, result.output


def test_orchard_eval_says_a_task_file_is_not_utf8(tmp_path):
    result = _eval(tmp_path, tasks=b'{"task_id": "\xff"}\n')
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "UTF-8" in result.output and "tasks.jsonl" in result.output


def test_orchard_eval_fails_when_no_attempt_was_valid(tmp_path, orchard_backend_settings):
    """Every attempt aborted (here the task's setup fails): the report is written, but the run
    is no success: a non-zero exit that says why."""
    made = tmp_path / "made.jsonl"
    assert CliRunner().invoke(cli, ["tasks", "generate", "--n", "1", "--out", str(made)]).exit_code == 0
    task = {**json.loads(made.read_text()), "setup": ["exit 3"]}
    config = yaml.safe_dump({"backend": {"name": "local", "settings": orchard_backend_settings["local"]},
                             "k": 2})  # a scalar k reads as [2]
    result = _eval(tmp_path, "--attempts", "2", "--out", str(tmp_path / "out"), config=config,
                   tasks=(json.dumps(task) + "\n").encode())
    assert result.exit_code == 1, (result.output, result.exception)
    assert "no valid attempt" in result.output and "rejected" in result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["attempts"] == 0 and report["attempts_all"] == 2 and report["pass_rate_all"] == 0.0
    assert report["pass_at_k_left_out"] == {"pass@2": {task["task_id"]: 0}}
