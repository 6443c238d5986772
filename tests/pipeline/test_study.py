"""The pipeline over seeds: the summary's arithmetic, and a real two-seed study with its ablation arms."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from orchard.cli.main import cli
from orchard.pipeline.study import markdown, summarize


def test_a_gap_is_beyond_the_spread_only_when_means_differ_by_more_than_both_stds_and_every_seed_agrees():
    summary = summarize({0: {"base": 0.10, "sft": 0.40, "sft+rl": 0.45},
                         1: {"base": 0.12, "sft": 0.42, "sft+rl": 0.41},
                         2: {"base": 0.08, "sft": 0.38, "sft+rl": 0.50}})
    gaps = {(g["from"], g["to"]): g for g in summary["gaps"]}
    assert summary["models"]["base"]["mean"] == pytest.approx(0.10)
    assert summary["models"]["base"]["std"] == pytest.approx(0.02)
    assert gaps[("base", "sft")]["beyond_spread"] and gaps[("base", "sft")]["gap"] == pytest.approx(0.30)
    assert gaps[("sft", "sft+rl")]["paired"] == pytest.approx([0.05, -0.01, 0.12])
    assert not gaps[("sft", "sft+rl")]["beyond_spread"], "one seed went down"
    assert ("sft+rl (dapo)", "sft+rl") not in gaps, "arms that did not run are not compared"
    one = summarize({0: {"base": 0.1, "sft": 0.9}})
    assert not one["gaps"][0]["beyond_spread"], "one seed has no spread to be beyond"
    partial = summarize({0: {"base": 0.1, "sft": 0.5, "sft (resolved)": 0.3}, 1: {"base": 0.2, "sft": 0.6}})
    assert partial["models"]["sft (resolved)"] == {"seeds": [0], "values": [0.3], "mean": 0.3, "std": 0.0}
    assert next(g for g in partial["gaps"] if g["from"] == "sft (resolved)")["seeds"] == [0]


def test_the_paired_reading_compares_each_seed_with_itself():
    """Session 15's figures: SFT 0.530/0.575/0.330, after three rounds of RL 0.740/0.780/0.490.
    Not beyond the spread of the seeds (0.192 < 0.288), beyond the paired spread (t = 12.1)."""
    summary = summarize({0: {"sft": 0.530, "sft+rl": 0.740}, 1: {"sft": 0.575, "sft+rl": 0.780},
                         2: {"sft": 0.330, "sft+rl": 0.490}})
    gap = summary["gaps"][0]
    assert not gap["beyond_spread"]
    reading = gap["paired_reading"]
    assert reading["mean"] == pytest.approx(0.19167, abs=1e-4)
    assert reading["std"] == pytest.approx(0.02754, abs=1e-4)
    assert reading["t"] == pytest.approx(12.05, abs=0.01) and reading["beyond"]
    noisy = summarize({0: {"sft": 0.5, "sft+rl": 0.6}, 1: {"sft": 0.5, "sft+rl": 0.4}, 2: {"sft": 0.5, "sft+rl": 0.65}})
    assert not noisy["gaps"][0]["paired_reading"]["beyond"], "t = 0.8: within the paired spread"
    same = summarize({0: {"sft": 0.5, "sft+rl": 0.75}, 1: {"sft": 0.25, "sft+rl": 0.5}})
    assert same["gaps"][0]["paired_reading"]["t"] == float("inf") and same["gaps"][0]["paired_reading"]["beyond"]
    one = summarize({0: {"sft": 0.5, "sft+rl": 0.9}})
    assert one["gaps"][0]["paired_reading"] == {"mean": pytest.approx(0.4), "std": 0.0, "t": None, "beyond": False}
    assert "| 0.028, +12.1 | yes |" in markdown(summary)


def test_a_two_seed_study_runs_every_arm_and_resumes_without_rerunning(orchard_backend_settings, kit_image,
                                                                       tmp_path):
    config = {"backend": {"name": "local", "settings": orchard_backend_settings["local"]}, "image": kit_image,
              "tasks": 16, "model": {"pretrain_steps": 2, "hidden_size": 32, "layers": 1, "heads": 2},
              "sft": {"epochs": 1, "global_batch_size": 4, "micro_batch_size": 4},
              "rl": {"steps": 5, "rollout_budget": 4, "tasks_per_step": 2, "group_size": 2, "max_rollouts": 4,
                     "stride": 2},
              "eval_attempts": 1, "concurrency": 4}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    args = ["pipeline", "--config", str(tmp_path / "pipeline.yaml"), "--output", str(tmp_path / "study"),
            "--seeds", "3,4", "--ablations"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "study" / "study.json").read_text())
    assert summary["seeds"] == [3, 4]
    assert set(summary["models"]) == {"base", "sft", "sft+rl", "sft (resolved)", "sft+rl (fixed)", "sft+rl (dapo)"}
    for seed in (3, 4):
        run = tmp_path / "study" / f"seed-{seed}"
        report = json.loads((run / "report.json").read_text())
        assert report["config"]["seed"] == seed
        spent = {name: json.loads((run / name / "metrics.jsonl").read_text().splitlines()[-1])["rollouts_spent"]
                 for name in ("rl", "rl-fixed", "rl-dapo")}
        assert all(4 <= n <= 4 + 3 * 2 * 4 for n in spent.values()), f"each sampler stops at its budget: {spent}"
        assert (run / "sft-resolved.jsonl").exists() and (run / "eval-sft-rl-dapo.jsonl").exists()
    assert "beyond the seed spread" in (tmp_path / "study" / "study.md").read_text()
    stamp = (tmp_path / "study" / "seed-3" / "report.json").stat().st_mtime_ns
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 0, again.output
    assert (tmp_path / "study" / "seed-3" / "report.json").stat().st_mtime_ns == stamp, "finished seeds are read back"
    # a stopped study is summarized from what each seed evaluated: the same figures as the reports
    summary_file = tmp_path / "study" / "study.json"
    summary_file.unlink()
    partial = CliRunner().invoke(cli, [*args[:5], "--seeds", "3,4,9", "--summarize"])
    assert partial.exit_code == 0, partial.output
    assert json.loads(summary_file.read_text())["models"] == summary["models"], "seed 9 never ran: left out"
    bad = CliRunner().invoke(cli, ["pipeline", "--seeds", "0,x"])
    assert bad.exit_code != 0 and "--seeds" in bad.output


def test_summarizing_a_study_started_from_another_reads_base_and_sft_where_they_were_evaluated(tmp_path):
    from orchard.pipeline.run import PipelineConfig
    from orchard.pipeline.study import run_study

    def evaluations(directory, model, resolved):
        directory.mkdir(parents=True, exist_ok=True)
        rows = [{"status": "completed", "grade": {"resolved": r}} for r in resolved]
        (directory / f"eval-{model}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    for seed in (0, 1):
        evaluations(tmp_path / "before" / f"seed-{seed}", "base", [False, False])
        evaluations(tmp_path / "before" / f"seed-{seed}", "sft", [True, False])
        evaluations(tmp_path / "before" / f"seed-{seed}", "sft-rl", [False, False])  # the earlier RL: not this study's
        evaluations(tmp_path / "after" / f"seed-{seed}", "sft-rl", [True, True])
    config = PipelineConfig(output_dir=tmp_path / "after", start_from=tmp_path / "before")
    summary = run_study(config, [0, 1], summarize_only=True)
    assert {model: row["values"] for model, row in summary["models"].items()} == {
        "base": [0.0, 0.0], "sft": [0.5, 0.5], "sft+rl": [1.0, 1.0]}


def test_summarizing_a_continuation_reads_what_its_earlier_run_reported_reused_evaluations_too(tmp_path):
    from orchard.pipeline.run import PipelineConfig
    from orchard.pipeline.study import run_study

    for seed in (0, 1):
        earlier = tmp_path / "first-rl" / f"seed-{seed}"  # itself reused base and SFT: no eval files of them
        earlier.mkdir(parents=True)
        (earlier / "report.json").write_text(json.dumps({"results": {
            "base": {"pass_rate": 0.1}, "sft": {"pass_rate": 0.5}, "sft+rl": {"pass_rate": 0.6}}}))
        later = tmp_path / "more" / f"seed-{seed}"
        later.mkdir(parents=True)
        (later / "eval-sft-rl-rl.jsonl").write_text(json.dumps({"status": "completed", "grade": {"resolved": True}}) + "\n")
    config = PipelineConfig(output_dir=tmp_path / "more", start_from=tmp_path / "first-rl", continue_rl=True)
    summary = run_study(config, [0, 1], summarize_only=True)
    assert {model: row["values"] for model, row in summary["models"].items()} == {
        "base": [0.1, 0.1], "sft": [0.5, 0.5], "sft+rl": [0.6, 0.6], "sft+rl+rl": [1.0, 1.0]}
    assert {(g["from"], g["to"]) for g in summary["gaps"]} >= {("sft+rl", "sft+rl+rl"), ("sft", "sft+rl+rl")}


def test_a_third_round_of_rl_is_compared_with_the_round_before_and_with_sft(tmp_path):
    from orchard.pipeline.run import PipelineConfig
    from orchard.pipeline.study import run_study

    for seed in (0, 1):
        earlier = tmp_path / "second" / f"seed-{seed}"  # a continuation: reports every round before it
        earlier.mkdir(parents=True)
        (earlier / "report.json").write_text(json.dumps({"results": {
            "base": {"pass_rate": 0.1}, "sft": {"pass_rate": 0.5}, "sft+rl": {"pass_rate": 0.6},
            "sft+rl+rl": {"pass_rate": 0.7}, "sft+rl+rl (dapo)": {"pass_rate": 0.0}}}))
        later = tmp_path / "third" / f"seed-{seed}"
        later.mkdir(parents=True)
        (later / "eval-sft-rl-rl-rl.jsonl").write_text(json.dumps({"status": "completed", "grade": {"resolved": True}}) + "\n")
        (later / "eval-sft-rl-rl-rl-dapo.jsonl").write_text(json.dumps({"status": "completed", "grade": {}}) + "\n")
    config = PipelineConfig(output_dir=tmp_path / "third", start_from=tmp_path / "second", continue_rl=True)
    summary = run_study(config, [0, 1], summarize_only=True)
    assert {model: row["values"][0] for model, row in summary["models"].items()} == {
        "base": 0.1, "sft": 0.5, "sft+rl": 0.6, "sft+rl+rl": 0.7, "sft+rl+rl+rl": 1.0, "sft+rl+rl+rl (dapo)": 0.0}
    assert list(summary["models"]) == ["base", "sft", "sft+rl", "sft+rl+rl", "sft+rl+rl+rl", "sft+rl+rl+rl (dapo)"]
    assert [(g["from"], g["to"]) for g in summary["gaps"]] == [
        ("base", "sft"), ("sft", "sft+rl"), ("sft+rl", "sft+rl+rl"), ("sft+rl+rl", "sft+rl+rl+rl"),
        ("sft", "sft+rl+rl"), ("sft", "sft+rl+rl+rl"), ("sft+rl+rl+rl (dapo)", "sft+rl+rl+rl")]


def test_model_names_round_trip_through_their_evaluation_files():
    from orchard.pipeline.names import model_of_slug, rl_model, rl_rounds, slug

    names = ["base", "sft", "sft (resolved)", "sft (credit)",
             *(f"{rl_model(k)}{arm}" for k in (1, 2, 5) for arm in ("", " (bar)", " (fixed)", " (dapo)"))]
    assert all(model_of_slug(slug(name)) == name for name in names)
    for stray in ("sft-rl-evil", "sft-dapo", "sft-rl-resolved", "sftrl", "base-rl", "", "sft-rl-rl-"):
        assert model_of_slug(stray) is None, stray
    assert [rl_rounds(n) for n in ("sft", "sft+rl+rl", "base", "sft+rl (dapo)", "sft+rlx")] == [0, 2, None, None, None]


def test_a_seed_finished_before_a_setting_was_added_is_not_run_again(tmp_path):
    from dataclasses import asdict

    from orchard.pipeline.run import PipelineConfig
    from orchard.pipeline.study import _finished

    config = PipelineConfig(output_dir=tmp_path / "seed-0")
    stored = json.loads(json.dumps(asdict(config), default=str))
    del stored["continue_rl"]  # written by a version without it
    config.output_dir.mkdir()
    (config.output_dir / "report.json").write_text(json.dumps({"config": stored, "results": {"sft+rl": {}}}))
    assert _finished(config, ablations=False) is not None
    stored["tasks"] += 1  # a setting that did change still counts
    (config.output_dir / "report.json").write_text(json.dumps({"config": stored, "results": {"sft+rl": {}}}))
    assert _finished(config, ablations=False) is None


def test_sft_data_names_its_choices():
    from orchard.pipeline.run import PipelineConfig

    assert PipelineConfig(output_dir=Path("x"), sft_data="credit-all").sft_data == "credit-all"
    with pytest.raises(ValueError, match="credit, credit-all, resolved"):
        PipelineConfig(output_dir=Path("x"), sft_data="credit_all")


def test_an_arm_run_from_a_studys_sft_weights_is_compared_with_its_models_only_when_rl_was_alike(tmp_path):
    from dataclasses import asdict

    from orchard.pipeline.run import PipelineConfig, arm_of, model_names, sibling_models
    from orchard.pipeline.study import _finished, run_study

    rl = {"steps": 9, "rollout_budget": 64}
    for seed in (0, 1):
        earlier = tmp_path / "bar" / f"seed-{seed}"
        earlier.mkdir(parents=True)
        stored = json.loads(json.dumps(asdict(PipelineConfig(output_dir=earlier, seed=seed, rl=rl)), default=str))
        (earlier / "report.json").write_text(json.dumps({"config": stored, "rl_rounds": 1, "results": {
            "base": {"pass_rate": 0.1}, "sft": {"pass_rate": 0.5}, "sft+rl": {"pass_rate": 0.6},
            "sft+rl (fixed)": {"pass_rate": 0.55}}}))
        later = tmp_path / "dapo" / f"seed-{seed}"
        later.mkdir(parents=True)
        (later / "eval-sft-rl-dapo.jsonl").write_text(json.dumps({"status": "completed", "grade": {"resolved": True}}) + "\n")
    config = PipelineConfig(output_dir=tmp_path / "dapo", start_from=tmp_path / "bar", rl={**rl, "sampler": "dapo"})
    summary = run_study(config, [0, 1], summarize_only=True)
    assert {model: row["values"][0] for model, row in summary["models"].items()} == {
        "base": 0.1, "sft": 0.5, "sft+rl": 0.6, "sft+rl (fixed)": 0.55, "sft+rl (dapo)": 1.0}
    assert {(g["from"], g["to"]) for g in summary["gaps"]} >= {("sft+rl (dapo)", "sft+rl"), ("sft+rl (fixed)", "sft+rl")}

    report = json.loads((tmp_path / "bar" / "seed-0" / "report.json").read_text())
    arm = PipelineConfig(output_dir=tmp_path / "x", rl={**rl, "sampler": "dapo"})
    assert model_names(arm, False, 1, report) == ("sft+rl (dapo)", {}, True)
    assert model_names(arm, False, 1, None) == ("sft+rl", {}, False)  # a run of its own: the recipe's name
    assert sibling_models(report, {"sft+rl (dapo)"}) == ["sft+rl", "sft+rl (fixed)"]
    assert sibling_models(report, {"sft+rl (dapo)", "sft+rl (fixed)"}) == ["sft+rl"]  # its own arms are its own
    for unlike in ({"rl": {**rl, "rollout_budget": 128, "sampler": "dapo"}}, {"rl_tasks": 300, "rl": rl},
                   {"split_seed": 0, "rl": {**rl, "sampler": "dapo"}}, {"rollout": {"max_turns": 2}, "rl": rl},
                   {"rl": rl}):  # the last: the same sampler, RL again (longer, or on another machine)
        assert not arm_of(report, PipelineConfig(output_dir=tmp_path / "x", **unlike)), unlike
    assert not arm_of({**report, "rl_rounds": 2}, arm)  # RL continued there: another round
    assert not arm_of({**report, "arm_of": "elsewhere"}, arm)  # an arm's SFT weights are another run's
    assert not arm_of(report, PipelineConfig(output_dir=tmp_path / "x", rl={**rl, "sampler": "dapo"},
                                             start_from=tmp_path, continue_rl=True))
    assert not arm_of({"results": report["results"]}, arm)  # no config: nothing to check against
    # a finished arm run (a bracketed model, no --ablations) is read back, not run again
    run = tmp_path / "dapo" / "seed-0"
    stored = json.loads(json.dumps(asdict(replace(config, seed=0, output_dir=run, start_from=tmp_path / "bar" / "seed-0")),
                                   default=str))
    (run / "report.json").write_text(json.dumps({"config": stored, "ablations": False, "arm_of": "bar",
                                                 "results": {"sft+rl": {}, "sft+rl (dapo)": {}}}))
    finished = replace(config, seed=0, output_dir=run, start_from=tmp_path / "bar" / "seed-0")
    assert _finished(finished, ablations=False) is not None and _finished(finished, ablations=True) is None


def test_rl_seed_sets_rls_draws_and_leaves_evaluation_on_the_runs_seed(tmp_path):
    """A cross design (one seed's SFT weights, another seed's RL) needs RL's task order,
    initialization and sampling from ``rl_seed``, and the evaluation's sampling from ``seed``
    (paired with the SFT model's evaluation of that seed)."""
    from orchard.pipeline.run import Pipeline, PipelineConfig, arm_of

    crossed = Pipeline(PipelineConfig(output_dir=tmp_path / "seed-1", seed=1, rl_seed=0), progress=False)
    plain = Pipeline(PipelineConfig(output_dir=tmp_path / "plain", seed=1), progress=False)
    assert crossed.rl_config("rl", "bar").seed == 0 and plain.rl_config("rl", "bar").seed == 1
    assert crossed.config.rl_randomness == 0 and plain.config.rl_randomness == 1
    # An arm differs from the run it starts from in its group sampler only: not in RL's draws
    # (the seed RL used, whether set as rl_seed or as seed), nor in evaluation's (seed).
    earlier = {"config": {**plain.report["config"], "rl": {**plain.config.rl, "sampler": "dapo"}}}
    assert arm_of(earlier, plain.config)
    assert not arm_of(earlier, crossed.config)
    assert arm_of(earlier, PipelineConfig(output_dir=tmp_path / "same-draws", seed=1, rl_seed=1))
    assert not arm_of(earlier, PipelineConfig(output_dir=tmp_path / "other-seed", seed=0))
    assert not arm_of(earlier, PipelineConfig(output_dir=tmp_path / "other-seed-same-rl", seed=0, rl_seed=1))


def test_an_arm_needs_the_same_rl_names_and_an_older_report_without_them_had_the_variants_own(tmp_path):
    from orchard.pipeline.run import PipelineConfig, arm_of

    plain = PipelineConfig(output_dir=tmp_path / "plain", rl_tasks=8)
    stored = json.loads(json.dumps({**plain.__dict__, "rl": {**plain.rl, "sampler": "dapo"}}, default=str))
    assert arm_of({"config": stored}, plain)
    older = {k: v for k, v in stored.items() if k != "rl_names"}  # written before rl_names existed
    assert arm_of({"config": older}, plain)
    assert not arm_of({"config": older}, replace(plain, rl_names="fresh"))
    assert arm_of({"config": {**stored, "rl_names": "fresh"}}, replace(plain, rl_names="fresh"))
