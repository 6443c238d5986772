"""The pipeline's pieces: choice tasks graded for real, the noisy expert, ground-truth values,
and a tiny end-to-end run through the CLI."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml
from click.testing import CliRunner

from orchard.cli.main import cli
from orchard.client.aio import AsyncClient
from orchard.pipeline.choice import CANDIDATES, buggy_function, choice_suite
from orchard.pipeline.expert import GroundTruthValues, NoisyExpert, TEST_COMMAND, UNDO, apply_command, trajectory_of
from orchard.rollout.actions import SUBMIT_TURN, bash_block
from orchard.rollout.engine import EngineConfig, RolloutEngine
from orchard.rollout.policies.scripted import ScriptedPolicy
from orchard.tasks.generated import generate_suite
from orchard.train.credit import Step, Trajectory


@pytest.fixture(scope="module")
def suite(kit_image):
    return choice_suite(generate_suite(12, seed=4, image=kit_image), size=6, seed=4)


def test_choice_tasks_number_their_candidates_and_name_the_fix_in_the_call_path(suite):
    for task in suite:
        choice = task.metadata["choice"]
        assert len(choice["candidates"]) >= 6 and choice["fix"] in choice["candidates"]
        assert choice["names"][choice["fix"]] == buggy_function(task)
        last_frame = [line for line in task.problem_statement.splitlines() if line.startswith("  File ")][-1]
        assert last_frame.endswith(f"(candidate {choice['fix']})")
        assert all(f"{CANDIDATES}/{n}.diff" in task.files for n in choice["candidates"])
        assert f"{CANDIDATES}/" in task.files[".gitignore"]
    assert len({t.metadata["choice"]["fix"] for t in suite}) > 1, "the right number varies"


def test_only_the_right_candidate_resolves_a_task_in_a_sandbox(orchard_backend_settings, suite):
    task = suite[0]
    choice = task.metadata["choice"]
    wrong = next(n for n in choice["candidates"] if n != choice["fix"])

    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            results = {}
            for pick in (choice["fix"], wrong):
                policy = ScriptedPolicy([bash_block(apply_command(pick)), SUBMIT_TURN])
                async with RolloutEngine(client, policy, EngineConfig(max_concurrent=1)) as engine:
                    sample = await engine.rollout(task)
                results[pick] = sample
            return results

    results = asyncio.run(main())
    assert results[choice["fix"]].reward == 1.0 and results[wrong].reward == -1.0
    assert CANDIDATES not in results[choice["fix"]].diff, "the candidates are ignored by git: not in the diff"


def test_ground_truth_values_follow_the_applied_candidate(suite):
    task = suite[1]
    fix, wrong = task.metadata["choice"]["fix"], next(n for n in task.metadata["choice"]["candidates"]
                                                      if n != task.metadata["choice"]["fix"])
    steps = [Step(bash_block(apply_command(fix))), Step(bash_block(TEST_COMMAND)), Step(bash_block(UNDO)),
             Step(bash_block(apply_command(wrong))), Step(SUBMIT_TURN)]
    values = asyncio.run(GroundTruthValues([task]).values(Trajectory(task.task_id, "", steps, False)))
    prior = 1 / len(task.metadata["choice"]["candidates"])
    assert values == [prior, 1.0, 1.0, prior, 0.0, 0.0]


def test_the_noisy_expert_leaves_good_steps_in_failed_trajectories(orchard_backend_settings, suite):
    async def main():
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            expert = NoisyExpert(suite, p_correct=0.6, p_recover=0.5, p_undo=0.5, seed=3)
            async with RolloutEngine(client, expert, EngineConfig(max_concurrent=4)) as engine:
                return await engine.run(suite, attempts=2)

    samples = asyncio.run(main())
    assert all(s.status.value == "completed" for s in samples)
    trajectories = [trajectory_of(s) for s in samples]
    undone = [t for t in trajectories if not t.resolved and any(UNDO == step.action.split("\n")[1]
                                                                   for step in t.steps)]
    assert undone, "some failures undid a right fix: steps that credit assignment keeps"
    values = GroundTruthValues(suite)
    for trajectory in undone:
        v = asyncio.run(values.values(trajectory))
        assert max(v) == 1.0 and v[-1] == 0.0


def test_the_noisy_experts_trajectories_do_not_depend_on_the_order_rollouts_ran_in(orchard_backend_settings, suite):
    """Each rollout draws from a stream keyed by the seed, its task, attempt and turn: one at a
    time or four at once, a seed gives the same trajectories (a shared generator, drawn from
    in whatever order rollouts reached it, gave different SFT data run to run)."""
    async def trajectories(concurrency: int) -> dict:
        async with AsyncClient(backend_settings=orchard_backend_settings["local"]) as client:
            expert = NoisyExpert(suite, p_correct=0.5, p_recover=0.5, p_undo=0.5, seed=11)
            async with RolloutEngine(client, expert, EngineConfig(max_concurrent=concurrency)) as engine:
                samples = await engine.run(suite, attempts=2)
        return {(s.task_id, s.attempt): [turn.text for turn in s.turns] for s in samples}

    one_at_a_time, four_at_once = asyncio.run(trajectories(1)), asyncio.run(trajectories(4))
    assert len(one_at_a_time) == 2 * len(suite)
    assert one_at_a_time == four_at_once
    assert len({tuple(turns) for turns in one_at_a_time.values()}) > 2, "the draws still differ between rollouts"


def test_orchard_pipeline_runs_end_to_end_with_tiny_budgets(orchard_backend_settings, kit_image, tmp_path):
    config = {"backend": {"name": "local", "settings": orchard_backend_settings["local"]}, "image": kit_image,
              "tasks": 16, "model": {"pretrain_steps": 3, "hidden_size": 32, "layers": 1, "heads": 2},
              "sft": {"epochs": 1, "global_batch_size": 4, "micro_batch_size": 4},
              "rl": {"steps": 1, "tasks_per_step": 2, "group_size": 2, "max_rollouts": 4, "stride": 2},
              "eval_attempts": 1, "concurrency": 4}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "pipeline.yaml"),
                                      "--output", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(report["results"]) == {"base", "sft", "sft+rl"}
    assert set(report["stages"]) >= {"tasks", "base model", "expert trajectories", "credit assignment", "sft", "rl"}
    assert "ground-truth values" in report["stages"]["credit assignment"]["values"]
    assert all(0 < facts["rss_mb"] <= facts["peak_rss_mb"] for facts in report["stages"].values()), report["stages"]
    for name in ("report.md", "report.png", "expert.jsonl", "sft.jsonl", "eval-base.jsonl", "eval-sft-rl.jsonl"):
        assert (tmp_path / "run" / name).exists(), name
    # RL again from that run's SFT weights: nothing before RL is redone, its evaluations reused
    (tmp_path / "again.yaml").write_text(yaml.safe_dump({**config, "start_from": str(tmp_path / "run"),
                                                         "rl": {**config["rl"], "steps": 2}}))
    again = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "again.yaml"),
                                     "--output", str(tmp_path / "again")])
    assert again.exit_code == 0, again.output
    rerun = json.loads((tmp_path / "again" / "report.json").read_text())
    assert {k: rerun["results"][k] for k in ("base", "sft")} == {k: report["results"][k] for k in ("base", "sft")}
    assert "sft+rl" in rerun["results"] and rerun["stages"]["rl"]["steps"] == 2
    assert not {"base model", "expert trajectories", "sft"} & set(rerun["stages"])
    assert rerun["stages"]["reused"]["run"] == str(tmp_path / "run")
    # another seed over that run's world: its base model and expert data reused, SFT and all after it run here
    (tmp_path / "world.yaml").write_text(yaml.safe_dump({**config, "world_seed": 0, "world_from": str(tmp_path / "run")}))
    seeded = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "world.yaml"), "--seed", "1",
                                      "--output", str(tmp_path / "seeded")])
    assert seeded.exit_code == 0, seeded.output
    over = json.loads((tmp_path / "seeded" / "report.json").read_text())
    assert not {"base model", "expert trajectories"} & set(over["stages"]) and "sft" in over["stages"]
    assert over["stages"]["world reused"]["trajectories"] == report["stages"]["expert trajectories"]["trajectories"]
    assert set(over["results"]) == {"base", "sft", "sft+rl"}
    for name in ("expert.jsonl", "base/model.safetensors", "world.json"):
        assert (tmp_path / "seeded" / name).read_bytes() == (tmp_path / "run" / name).read_bytes(), name
    for field, value in (("expert", {"p_correct": 0.9}), ("expert_attempts", 2), ("world_seed", 3)):
        (tmp_path / "other-world.yaml").write_text(yaml.safe_dump({**config, field: value,
                                                                   "world_from": str(tmp_path / "run")}))
        other = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "other-world.yaml"),
                                         "--output", str(tmp_path / f"other-{field}")])
        says = "tasks" if field == "world_seed" else field  # another world seed makes other tasks
        assert other.exit_code == 2 and "world_from" in other.output and says in other.output, other.output
    (tmp_path / "both.yaml").write_text(yaml.safe_dump({**config, "world_from": str(tmp_path / "run"),
                                                        "start_from": str(tmp_path / "run")}))
    both = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "both.yaml")])
    assert both.exit_code != 0 and "exclude each other" in both.output
    # another group sampler from that run's SFT weights, RL otherwise alike: an arm beside its BAR model
    (tmp_path / "arm.yaml").write_text(yaml.safe_dump({**config, "start_from": str(tmp_path / "run"),
                                                       "rl": {**config["rl"], "sampler": "dapo"}}))
    arm = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "arm.yaml"), "--output", str(tmp_path / "arm")])
    assert arm.exit_code == 0, arm.output
    armed = json.loads((tmp_path / "arm" / "report.json").read_text())
    assert list(armed["results"]) == ["base", "sft", "sft+rl", "sft+rl (dapo)"]
    assert armed["results"]["sft+rl"] == report["results"]["sft+rl"]  # the earlier run's, as it evaluated it
    assert armed["stages"]["rl"]["sampler"] == "dapo" and (tmp_path / "arm" / "eval-sft-rl-dapo.jsonl").exists()
    assert armed["arm_of"] == str(tmp_path / "run") and "is an arm of" in (tmp_path / "arm" / "report.md").read_text()
    (tmp_path / "arm-more.yaml").write_text(yaml.safe_dump({**config, "start_from": str(tmp_path / "arm"),
                                                            "continue_rl": True}))
    arm_more = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "arm-more.yaml"),
                                        "--output", str(tmp_path / "arm-more")])
    assert arm_more.exit_code == 2 and "is an arm of" in arm_more.output, arm_more.output  # its sft+rl is not its RL
    # RL continued from that run's SFT+RL weights, on RL tasks after the ones it trained on
    (tmp_path / "more.yaml").write_text(yaml.safe_dump({**config, "start_from": str(tmp_path / "run"),
                                                        "continue_rl": True, "rl_tasks": 4}))
    more = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "more.yaml"),
                                    "--output", str(tmp_path / "more")])
    assert more.exit_code == 0, more.output
    continued = json.loads((tmp_path / "more" / "report.json").read_text())
    assert {k: continued["results"][k] for k in ("base", "sft", "sft+rl")} == {
        k: report["results"][k] for k in ("base", "sft", "sft+rl")}
    assert "sft+rl+rl" in continued["results"] and (tmp_path / "more" / "eval-sft-rl-rl.jsonl").exists()
    assert continued["stages"]["reused"]["rl_checkpoint"].startswith("checkpoint-")
    assert continued["stages"]["rl tasks"]["after_earlier_runs"] == 0  # the first run trained on SFT's tasks
    (tmp_path / "chain.yaml").write_text(yaml.safe_dump({**config, "start_from": str(tmp_path / "more"),
                                                         "continue_rl": True, "rl_tasks": 4}))
    chained = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "chain.yaml"),
                                       "--output", str(tmp_path / "chained")])
    assert chained.exit_code == 0, chained.output  # a continuation continued: a third round, on further tasks
    third = json.loads((tmp_path / "chained" / "report.json").read_text())
    assert list(third["results"]) == ["base", "sft", "sft+rl", "sft+rl+rl", "sft+rl+rl+rl"]
    assert {k: third["results"][k] for k in ("base", "sft", "sft+rl", "sft+rl+rl")} == {
        k: continued["results"][k] for k in ("base", "sft", "sft+rl", "sft+rl+rl")}
    assert (third["rl_rounds"], third["rl_tasks_used"]) == (3, 8) and (continued["rl_rounds"], report["rl_rounds"]) == (2, 1)
    assert third["stages"]["rl tasks"]["after_earlier_runs"] == 4
    assert (tmp_path / "chained" / "eval-sft-rl-rl-rl.jsonl").exists()
    (tmp_path / "again" / "rl").rename(tmp_path / "rl-moved")  # a run whose RL stage is missing
    (tmp_path / "from-again.yaml").write_text(yaml.safe_dump({**config, "start_from": str(tmp_path / "again"),
                                                              "continue_rl": True}))
    no_rl = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "from-again.yaml"),
                                     "--output", str(tmp_path / "no-rl")])
    assert no_rl.exit_code == 2 and "no finished RL stage" in no_rl.output, no_rl.output
    (tmp_path / "lone.yaml").write_text(yaml.safe_dump({**config, "continue_rl": True}))
    lone = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "lone.yaml")])
    assert lone.exit_code != 0 and "continue_rl needs start_from" in lone.output
    other_seed = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "again.yaml"), "--seed", "5",
                                          "--output", str(tmp_path / "other")])
    assert other_seed.exit_code == 2 and "start_from" in other_seed.output and "tasks" in other_seed.output
    (tmp_path / "run" / "base").rename(tmp_path / "base-moved")  # a run dir put together by hand, missing a part
    no_base = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "again.yaml"),
                                       "--output", str(tmp_path / "no-base")])
    assert no_base.exit_code == 2 and "no base model" in no_base.output, no_base.output
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**config, "epochs": 3}))
    bad = CliRunner().invoke(cli, ["pipeline", "--config", str(tmp_path / "bad.yaml")])
    assert bad.exit_code != 0 and "epochs" in bad.output


def test_rl_tasks_are_training_tasks_that_sft_never_sees(kit_image, tmp_path):
    from orchard.pipeline.run import Pipeline, PipelineConfig

    def pools(out):
        pipeline = Pipeline(PipelineConfig(output_dir=tmp_path / out, tasks=16, rl_tasks=7, image=kit_image),
                            progress=False)
        return pipeline.make_tasks(), pipeline.make_rl_tasks()

    (train, heldout), rl = pools("a")
    assert len(rl) == 7 and all(t.split == "train" and t.metadata["choice"] for t in rl)
    assert not {t.task_id for t in rl} & {t.task_id for t in train + heldout}
    assert not {t.files["README.md"] for t in rl} & {t.files["README.md"] for t in train}  # other repositories
    pools("b")  # the same seed again: the same tasks, and the suite's own are unchanged by rl_tasks
    for name in ("rl-tasks.jsonl", "tasks.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    alone = Pipeline(PipelineConfig(output_dir=tmp_path / "c", tasks=16, image=kit_image), progress=False)
    assert alone.make_rl_tasks() == [] and alone.make_tasks() == (train, heldout)
    with pytest.raises(ValueError, match="rl_tasks"):
        PipelineConfig(output_dir=tmp_path / "d", rl_tasks=-1)


def test_a_split_seed_holds_out_its_variants_from_sft_and_from_rl(kit_image, tmp_path):
    from orchard.pipeline.run import Pipeline, PipelineConfig
    from orchard.tasks.generated import heldout_variants

    pipeline = Pipeline(PipelineConfig(output_dir=tmp_path, seed=1, split_seed=2, tasks=48, rl_tasks=12,
                                       image=kit_image), progress=False)
    (train, heldout), rl = pipeline.make_tasks(), pipeline.make_rl_tasks()
    shapes = {(v.family, v.name) for v in heldout_variants(2, 0.25)}
    assert {tuple(t.tags[:2]) for t in heldout} == shapes
    assert not shapes & {tuple(t.tags[:2]) for t in train + rl}


def test_a_world_seed_gives_every_seed_the_same_tasks_and_base_model(kit_image, tmp_path):
    """Seeds over one world vary training alone, as seeds over one data set and one
    pretrained checkpoint do; without it a seed changes the world as well. (The expert's
    seed is ``config.world`` too, read in Pipeline.expert_trajectories, not run here.)"""
    import torch

    from orchard.pipeline.run import Pipeline, PipelineConfig

    small = {"image": kit_image, "tasks": 24, "rl_tasks": 6, "model": {"pretrain_steps": 2}}

    def world(out: str, **seeds: int) -> tuple:
        pipeline = Pipeline(PipelineConfig(output_dir=tmp_path / out, **small, **seeds), progress=False)
        train, heldout = pipeline.make_tasks()
        rl = pipeline.make_rl_tasks()
        model, _ = pipeline.base_model(train)
        return (train, heldout, rl), [p.detach().clone() for p in model.parameters()], pipeline.config.world

    one, two, alone = world("one", seed=0, world_seed=5), world("two", seed=1, world_seed=5), world("alone", seed=1)
    assert one[0] == two[0] and one[0] != alone[0]
    assert all(torch.equal(a, b) for a, b in zip(one[1], two[1]))
    assert not all(torch.equal(a, b) for a, b in zip(one[1], alone[1]))
    assert (one[2], two[2], alone[2]) == (5, 5, 1)


def test_a_continuation_trains_on_the_rl_tasks_after_its_earlier_runs(kit_image, tmp_path):
    from orchard.pipeline.run import Pipeline, PipelineConfig

    settings = {"image": kit_image, "tasks": 16, "rl_tasks": 4}
    first = Pipeline(PipelineConfig(output_dir=tmp_path / "first", **settings), progress=False)
    first_ids = {t.task_id for t in first.make_rl_tasks()}
    (tmp_path / "first" / "report.json").write_text(json.dumps({"config": {"rl_tasks": 4}}))
    later = Pipeline(PipelineConfig(output_dir=tmp_path / "later", start_from=tmp_path / "first", continue_rl=True,
                                    **settings), progress=False)
    assert later.chain_so_far() == (4, 1)
    later_ids = {t.task_id for t in later.make_rl_tasks(skip=4)}
    assert len(first_ids) == 4 and len(later_ids) == 4 and not later_ids & first_ids
    assert later.report["stages"]["rl tasks"]["after_earlier_runs"] == 4

    def third_after(report: dict) -> tuple[int, int]:
        (tmp_path / "later" / "report.json").write_text(json.dumps(report))
        third = Pipeline(PipelineConfig(output_dir=tmp_path / "third", start_from=tmp_path / "later",
                                        continue_rl=True, **settings), progress=False)
        return third.chain_so_far()

    # a continuation of a continuation comes after both, whether the report says how many tasks its chain
    # used or (written before it did) how many it skipped, or only where it started from
    older = {"config": {"rl_tasks": 4, "continue_rl": True, "start_from": str(tmp_path / "first")}}
    assert third_after({**older, "rl_tasks_used": 8, "rl_rounds": 2}) == (8, 2)
    assert third_after({**older, "stages": {"rl tasks": {"after_earlier_runs": 4}}}) == (8, 2)
    assert third_after(older) == (8, 2)
    zero = {"config": {**older["config"], "rl_tasks": 0}}  # it trained on SFT's tasks: the first run's still count
    assert third_after(zero) == (4, 2)
    third_ids = {t.task_id for t in Pipeline(PipelineConfig(output_dir=tmp_path / "x", **settings),
                                             progress=False).make_rl_tasks(skip=8)}
    assert len(third_ids) == 4 and not third_ids & (first_ids | later_ids)


@pytest.mark.parametrize("report, says", [
    ({"config": {}, "rl_tasks_used": "eight"}, "rl_tasks_used"), ({"config": {}, "rl_tasks_used": -4}, "rl_tasks_used"),
    ({"config": {}, "rl_tasks_used": None}, "rl_tasks_used"), ({"config": {}, "rl_tasks_used": True}, "rl_tasks_used"),
    ({"config": {}, "rl_tasks_used": 0, "rl_rounds": -3}, "rl_rounds"),
    ({"config": {}, "rl_tasks_used": 0, "rl_rounds": 0}, "rl_rounds"),
    ({"config": {}, "rl_tasks_used": 0, "rl_rounds": "three"}, "rl_rounds"),
    ({"config": {"rl_tasks": 2.5}}, "config.rl_tasks"),
    ({"config": {"rl_tasks": 0, "continue_rl": True}}, "does not say which RL tasks"),
    ([1, 2], "not a pipeline report"), ({"config": [1]}, "not a pipeline report")])
def test_a_malformed_earlier_report_is_refused_never_read_as_a_default(tmp_path, report, says):
    from orchard.pipeline.chain import PipelineInputError
    from orchard.pipeline.run import Pipeline, PipelineConfig

    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "report.json").write_text(json.dumps(report))
    later = Pipeline(PipelineConfig(output_dir=tmp_path / "later", start_from=tmp_path / "earlier",
                                    continue_rl=True), progress=False)
    with pytest.raises(PipelineInputError, match=says):
        later.chain_so_far()


def test_a_run_keeps_its_own_base_model_replacing_a_link_or_stale_files_never_writing_through(tmp_path):
    from orchard.pipeline.model import BaseModelConfig, build_model, build_tokenizer
    from orchard.pipeline.run import Pipeline, PipelineConfig

    tokenizer = build_tokenizer(["def f(x): return x + 1"] * 4, 300)
    model = build_model(tokenizer, BaseModelConfig(hidden_size=16, layers=1, heads=2), 0)
    run = Pipeline(PipelineConfig(output_dir=tmp_path / "run"), progress=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run" / "base").symlink_to(elsewhere)  # a link planted where the copy goes
    run._keep_base(model, tokenizer)
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "run" / "base").is_symlink()
    (tmp_path / "run" / "base" / "stale.safetensors").write_text("left by another run")
    run._keep_base(model, tokenizer)
    kept = {p.name for p in (tmp_path / "run" / "base").iterdir()}
    assert "config.json" in kept and "stale.safetensors" not in kept
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".base-")]


def test_fresh_rl_names_leave_no_name_of_a_variant_in_rls_call_paths_and_the_suite_as_it_was(kit_image, tmp_path):
    """On training variants a function's name (one of its variant's three) tells where the bug
    is; held-out variants' names are never seen, so only the call path's last frame does. RL on
    fresh-named tasks rewards reading that frame, not remembering names."""
    import re

    from orchard.pipeline.run import Pipeline, PipelineConfig
    from orchard.tasks.bugs import VARIANTS

    own = {n for v in VARIANTS for n in (*v.helper_names, *v.caller_names)}

    def pools(out, **settings):
        pipeline = Pipeline(PipelineConfig(output_dir=tmp_path / out, tasks=16, rl_tasks=9, image=kit_image,
                                           **settings), progress=False)
        return pipeline.make_tasks(), pipeline.make_rl_tasks(), pipeline

    (train, heldout), named, _ = pools("variant")
    (train_f, heldout_f), fresh, pipeline = pools("fresh", rl_names="fresh")
    assert (train_f, heldout_f) == (train, heldout)
    assert [t.task_id for t in fresh] == [t.task_id for t in named] and fresh != named

    def frames(task):
        return re.findall(r"in (\w+) \(candidate (\d+)\)", task.problem_statement)

    assert all(frames(t) and {name for name, _ in frames(t)} <= own for t in named)
    for task in fresh:
        found = frames(task)
        assert found and not {name for name, _ in found} & own, found
        assert found[-1][1] == task.metadata["choice"]["fix"]  # the last frame still holds the fix
    assert pipeline.report["stages"]["rl tasks"]["names"] == "fresh"
    for bad, message in (({"rl_names": "fresh"}, "needs rl_tasks"), ({"rl_names": "odd", "rl_tasks": 2}, "rl_names")):
        with pytest.raises(ValueError, match=message):
            PipelineConfig(output_dir=tmp_path / "bad", **bad)
