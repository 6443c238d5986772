"""The recipe end to end: base model, expert trajectories, credit-assignment SFT, BAR+GRPO,
and success on held-out tasks after each stage (``orchard pipeline``).

Stages, each writing into ``output_dir``: tasks (generated suite as choice tasks, train and
held-out splits, and with ``rl_tasks`` a training pool of RL's own), base model (built and
pre-trained here unless ``base_model`` names a checkpoint), expert trajectories (a scripted noisy expert in sandboxes), credit assignment
(ground-truth values, named as such, unless a teacher endpoint is configured), SFT, RL, and
an evaluation of base, SFT and SFT+RL on the held-out split. Every sandbox comes from the
backend in the config; the report (JSON, Markdown, PNG) says what ran.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import shutil
import tempfile
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from orchard.pipeline.chain import PipelineInputError, dig, read_report, rl_rounds_of_run, rl_tasks_used
from orchard.pipeline.model import BaseModelConfig
from orchard.pipeline.names import SAMPLERS, rl_model, rl_rounds, slug
from orchard.train.memory import memory_mb

if TYPE_CHECKING:
    from orchard.train.rl_config import RLConfig

SYSTEM = "You fix bugs in a git repository. Reply with one ```bash block per turn; a block holding only submit ends."


SFT_DATA = ("credit", "credit-all", "resolved")
RL_NAMES = ("variant", "fresh")


@dataclass
class PipelineConfig:
    output_dir: Path = field(metadata={"help": "everything the run writes"})
    seed: int = field(default=0, metadata={"help": "SFT's data order, RL's and evaluation's sampling; and, unless "
                                                   "world_seed is set, the tasks, base model and expert"})
    backend: dict = field(default_factory=lambda: {"name": "local"}, metadata={"help": "{name, settings}"})
    image: Optional[str] = field(default=None, metadata={"help": "image with python3 and git (default: built here)"})
    tasks: int = field(default=400, metadata={"help": "generated tasks (train + held-out)"})
    heldout_fraction: float = field(default=0.25, metadata={"help": "share of held-out variants"})
    world_seed: Optional[int] = field(default=None, metadata={
        "help": "the tasks, split, base model and expert trajectories come from this seed, whatever `seed` is "
                "(default: `seed`'s own): a study over seeds then varies SFT's and RL's training and sampling "
                "alone, as seeds do over one data set and one pretrained checkpoint"})
    split_seed: Optional[int] = field(default=None, metadata={
        "help": "hold out the variants this seed picks, whatever `seed` is (default: the world's, see world_seed): a study over "
                "seeds then judges every seed on the same code shapes, and its spread is training's alone"})
    rl_seed: Optional[int] = field(default=None, metadata={
        "help": "RL's task order and sampling (default: `seed`'s own; evaluation keeps `seed`'s): "
                "with start_from, one seed's SFT weights trained by another seed's RL, to tell what a seed's RL "
                "result owes to its SFT model from what it owes to RL's own draws"})
    candidates: int = field(default=6, metadata={"help": "candidate fixes per task (chance = 1/this)"})
    rl_tasks: int = field(default=0, metadata={
        "help": "training-split tasks generated for RL alone, after the others (never seen by the expert or SFT); "
                "0: RL draws from SFT's own training tasks"})
    rl_names: str = field(default="variant", metadata={
        "help": "variant (RL's own tasks name functions as the suite does: each variant from its own three "
                "names) | fresh (every function of RL's own tasks named from a pool no variant uses: a name "
                "seen in training then never tells where the bug is, as on held-out variants, so RL rewards "
                "reading the call path; needs rl_tasks)"})
    base_model: Optional[str] = field(default=None, metadata={"help": "a Hugging Face checkpoint instead of the "
                                                                     "small model built here"})
    start_from: Optional[Path] = field(default=None, metadata={
        "help": "an earlier run of the same seed and tasks: its base model, SFT weights and their evaluations are "
                "reused, and only RL and what follows runs (with --seeds: its seed-N directories)"})
    world_from: Optional[Path] = field(default=None, metadata={
        "help": "an earlier run of this run's world (the same tasks, base model settings and expert): its base "
                "model and expert trajectories are reused, and everything after them runs here, the base model's "
                "evaluation included; a study over seeds with one world_seed builds its world once"})
    continue_rl: bool = field(default=False, metadata={
        "help": "with start_from: RL goes on from that run's RL weights (also the KL reference), on rl_tasks "
                "further tasks generated after every RL task its chain of runs used; its evaluations are kept and "
                "this run's model has one more +rl (sft+rl+rl, then sft+rl+rl+rl, ...)"})
    model: BaseModelConfig = field(default_factory=BaseModelConfig)
    expert_attempts: int = field(default=1, metadata={"help": "expert trajectories per training task"})
    expert: dict = field(default_factory=lambda: {"p_correct": 0.5, "p_recover": 0.5, "p_undo": 0.25})
    teacher: Optional[dict] = field(default=None, metadata={"help": "{base_url, model}: an LLM teacher for V(t) "
                                                                   "(default: ground-truth values)"})
    sft_data: str = field(default="credit", metadata={
        "help": "credit (ascending segments of failed trajectories, resolved ones in full) | credit-all (resolved "
                "ones graded too: their descending actions, a wrong try they undid, are not trained) | "
                "resolved (ablation)"})
    sft: dict = field(default_factory=lambda: {"epochs": 20, "learning_rate": 1e-3, "min_learning_rate": 1e-4,
                                               "global_batch_size": 8, "micro_batch_size": 8})
    rl: dict = field(default_factory=lambda: {"steps": 24, "rollout_budget": 384, "tasks_per_step": 8, "group_size": 4,
                                              "max_rollouts": 8, "stride": 4, "learning_rate": 1e-4,
                                              "loss": {"kl_coef": 0.1}, "micro_batch_size": 8})
    rollout: dict = field(default_factory=lambda: {"max_turns": 5, "max_tokens_per_turn": 48,
                                                   "max_total_tokens": 1024, "time_limit_seconds": 120})
    eval_attempts: int = field(default=2, metadata={"help": "attempts per held-out task and model"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (training and evaluation)"})
    concurrency: int = field(default=16, metadata={"help": "rollout sandboxes at once"})

    @property
    def rl_randomness(self) -> int:
        """The seed of RL's draws (``rl_seed``, else ``seed``)."""
        return self.seed if self.rl_seed is None else self.rl_seed

    @property
    def world(self) -> int:
        """The seed of what the run is given rather than what it trains: tasks, base model, expert."""
        return self.seed if self.world_seed is None else self.world_seed

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        self.start_from = Path(self.start_from) if self.start_from else None
        self.world_from = Path(self.world_from) if self.world_from else None
        if isinstance(self.model, dict):
            self.model = BaseModelConfig(**self.model)
        if self.rl_tasks < 0 or (self.rl_tasks and not 0 <= self.heldout_fraction < 1):
            raise ValueError("rl_tasks must be >= 0, and with rl_tasks heldout_fraction must be below 1")
        if self.continue_rl and not self.start_from:
            raise ValueError("continue_rl needs start_from: the run whose RL it continues")
        if self.world_from and self.start_from:
            raise ValueError("world_from and start_from exclude each other: start_from reuses the world as well")
        if self.rl_names not in RL_NAMES:
            raise ValueError(f"rl_names must be one of {', '.join(RL_NAMES)}, not {self.rl_names!r}")
        if self.rl_names == "fresh" and not self.rl_tasks:
            raise ValueError("rl_names: fresh needs rl_tasks (it names RL's own tasks; SFT's are the suite's)")
        if self.sft_data not in SFT_DATA:
            raise ValueError(f"sft_data must be one of {', '.join(SFT_DATA)}, not {self.sft_data!r}")


QUICK = {"tasks": 160, "model": {"pretrain_steps": 100}, "expert_attempts": 1, "eval_attempts": 1,
         "sft": {"epochs": 20, "learning_rate": 1e-3, "min_learning_rate": 1e-4, "global_batch_size": 8,
                 "micro_batch_size": 8},
         "rl": {"steps": 4, "tasks_per_step": 6, "group_size": 4, "max_rollouts": 8, "stride": 4,
                "learning_rate": 1e-4, "loss": {"kl_coef": 0.1}, "micro_batch_size": 8}}


class Pipeline:
    def __init__(self, config: PipelineConfig, progress: bool = True) -> None:
        self.config, self.progress = config, progress
        self.report: dict[str, Any] = {"config": json.loads(json.dumps(asdict(config), default=str)), "stages": {}}
        config.output_dir.mkdir(parents=True, exist_ok=True)

    def _stage(self, name: str, started: float, **facts: Any) -> None:
        self.report["stages"][name] = {"seconds": round(time.perf_counter() - started, 1), **facts, **memory_mb()}
        if self.progress:
            from orchard.cli.common import out

            out.print(f"[green]{name}[/green] {self.report['stages'][name]}")

    async def run(self, ablations: bool = False) -> dict[str, Any]:
        """The recipe; with ``ablations``, also the other SFT data (from the same base model and
        expert trajectories) and the other group samplers (from the same SFT weights, with the
        same rollout budget), each evaluated on the same held-out tasks."""
        from orchard.client.aio import AsyncClient

        config = self.config
        random.seed(config.seed)
        backend = config.backend
        async with AsyncClient(backend=backend.get("name", "local"), backend_settings=backend.get("settings")) as client:
            self.client = client
            train, heldout = self.make_tasks()
            skip, rounds_before = self.chain_so_far()
            rl_pool = self.make_rl_tasks(skip=skip) or train
            self.report["rl_tasks_used"] = skip + config.rl_tasks
            self.report["rl_rounds"] = rounds = rounds_before + 1
            earlier: Any = None
            if config.start_from:
                model, tokenizer, results, earlier = self.reuse(config.start_from,
                                                                "rl" if config.continue_rl else "sft")
            else:
                world = self.reuse_world(config.world_from) if config.world_from else None
                model, tokenizer = world[:2] if world else self.base_model(train)
                base_weights = copy.deepcopy(model.state_dict())
                results = {"base": await self.evaluate("base", model, tokenizer, heldout)}
                trajectories = world[2] if world else await self.expert_trajectories(train)
                examples = await self.credit(trajectories, train, config.sft_data)
                self.sft(model, tokenizer, examples, "sft")
                results["sft"] = await self.evaluate("sft", model, tokenizer, heldout)
            sampler, _ = rl_arms(config, ablations)
            final, arms, is_arm = model_names(config, ablations, rounds, earlier)
            if is_arm:  # the run it is an arm of: its first-round RL models, set beside this one's
                results.update({name: earlier["results"][name]
                                for name in sibling_models(earlier, {final, *arms.values()})})
                self.report["arm_of"] = str(config.start_from)
            self.report["rl_model"], self.report["ablations"] = final, ablations
            start_weights = copy.deepcopy(model.state_dict())
            if final in results:
                raise PipelineInputError(f"start_from: {config.start_from} already holds a model named {final}")
            await self.rl(model, tokenizer, rl_pool, sampler, "rl")
            results[final] = await self.evaluate(final, model, tokenizer, heldout)
            if ablations and not config.start_from:
                other = "credit" if config.sft_data == "resolved" else "resolved"
                model.load_state_dict(base_weights)
                self.sft(model, tokenizer, await self.credit(trajectories, train, other), f"sft-{other}")
                results[f"sft ({other})"] = await self.evaluate(f"sft ({other})", model, tokenizer, heldout)
            for arm, name in arms.items():
                model.load_state_dict(start_weights)
                await self.rl(model, tokenizer, rl_pool, arm, f"rl-{arm}")
                results[name] = await self.evaluate(name, model, tokenizer, heldout)
        self.report["results"] = results
        from orchard.pipeline.report import write_report

        write_report(self.report, config.output_dir)
        return self.report

    # -- stages ------------------------------------------------------------------------
    def make_tasks(self) -> tuple[list, list]:
        from orchard.pipeline.choice import choice_suite
        from orchard.tasks import save_tasks
        from orchard.tasks.generated import generate_suite

        started = time.perf_counter()
        config = self.config
        image = self._image()
        suite = choice_suite(generate_suite(config.tasks, config.world, image, config.heldout_fraction,
                                            split_seed=config.split_seed),
                             config.candidates, config.world)
        save_tasks(suite, config.output_dir / "tasks.jsonl")
        train = [t for t in suite if t.split == "train"]
        heldout = [t for t in suite if t.split != "train"]
        self._stage("tasks", started, train=len(train), heldout=len(heldout), image=image,
                    families=sorted({t.tags[0] for t in suite if t.tags}))
        return train, heldout

    def _image(self) -> str:
        return self.config.image or str(_default_image())

    def chain_so_far(self) -> tuple[int, int]:
        """RL tasks of their own the runs before this one used, and the rounds of RL in the
        weights it starts from: (0, 0) unless it continues RL (``orchard.pipeline.chain``)."""
        if not self.config.continue_rl:
            return 0, 0
        earlier = read_report(self.config.start_from)
        return rl_tasks_used(self.config.start_from, earlier), rl_rounds_of_run(self.config.start_from, earlier)

    def make_rl_tasks(self, skip: int = 0) -> list:
        """``rl_tasks`` training-split tasks that come after the suite's (and after the first
        ``skip`` of those: an earlier run's RL tasks): the same families and variants, other
        repositories, never seen by the expert or SFT, so RL meets tasks it has not memorised
        (the original ran RL on tasks of their own, filtered by difficulty)."""
        from orchard.pipeline.choice import choice_suite
        from orchard.tasks import save_tasks
        from orchard.tasks.generated import generate_suite

        config = self.config
        if not config.rl_tasks:
            return []
        started = time.perf_counter()
        image = self._image()
        wanted = skip + config.rl_tasks
        total = config.tasks + wanted
        while True:
            fresh = [t for t in generate_suite(total, config.world, image, config.heldout_fraction,
                                               split_seed=config.split_seed,
                                               fresh_names=config.rl_names == "fresh")[config.tasks:]
                     if t.split == "train"]
            if len(fresh) >= wanted:
                break
            total += wanted - len(fresh)
        tasks = choice_suite(fresh[skip:wanted], config.candidates, config.world)
        save_tasks(tasks, config.output_dir / "rl-tasks.jsonl")
        self._stage("rl tasks", started, tasks=len(tasks), after_earlier_runs=skip,
                    names=config.rl_names, note="training split, generated after the suite's tasks")
        return tasks

    def base_model(self, train: list) -> tuple[Any, Any]:
        started = time.perf_counter()
        config = self.config
        if config.base_model:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.base_model)
            model = AutoModelForCausalLM.from_pretrained(config.base_model).eval()
            self._stage("base model", started, checkpoint=config.base_model)
            return model, tokenizer
        from orchard.pipeline.model import build_model, build_tokenizer, pretrain, random_conversation

        rng = random.Random(config.world)
        texts = [m["content"] for task in train for m in random_conversation(task, SYSTEM, rng)]
        tokenizer = build_tokenizer(texts + [SYSTEM], config.model.vocab_size)
        model = build_model(tokenizer, config.model, config.world)
        losses = pretrain(model, tokenizer, train, SYSTEM, config.model, config.world)
        model.save_pretrained(config.output_dir / "base")
        tokenizer.save_pretrained(config.output_dir / "base")
        self._stage("base model", started, built_here=True, parameters=sum(p.numel() for p in model.parameters()),
                    pretrain_loss_first=round(losses[0], 3), pretrain_loss_last=round(losses[-1], 3),
                    note="a small Llama pre-trained here on random-choice conversations of the training tasks")
        return model, tokenizer

    def reuse(self, earlier: Path, stage: str) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        """The base model and the weights ``stage`` ("sft" or "rl") left in an ``earlier`` run
        on the same tasks, its evaluations up to them, and its report, so RL can be run again
        (longer, or otherwise) or continued without redoing what came before. Refused if that
        run's tasks differ from this one's, and RL continued from an arm run."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        started = time.perf_counter()
        self._same_tasks(earlier, "start_from")
        checkpoints = sorted((d for d in (earlier / stage).glob("checkpoint-*") if d.name[len("checkpoint-"):].isdigit()),
                             key=lambda d: int(d.name[len("checkpoint-"):]))
        report = earlier / "report.json"
        if not checkpoints or not report.exists():
            raise PipelineInputError(f"start_from: {earlier} has no finished {stage.upper()} stage "
                                     f"({stage}/checkpoint-N and report.json)")
        earlier_report = read_report(earlier)
        steps = dig(earlier_report, "stages", stage, "steps")
        named = earlier / stage / f"checkpoint-{steps}"  # the run's own last step, not a leftover of another
        checkpoint = named if steps is not None and (named / "state.pt").exists() else checkpoints[-1]
        if not (earlier / "base" / "config.json").is_file():
            raise PipelineInputError(f"start_from: {earlier} has no base model (base/config.json and its tokenizer)")
        earlier_results = earlier_report.get("results")
        if not isinstance(earlier_results, dict):
            raise PipelineInputError(f"start_from: {earlier}/report.json has no results (the run did not finish)")
        if stage == "rl" and earlier_report.get("arm_of"):
            raise PipelineInputError(f"start_from: {earlier} is an arm of {earlier_report['arm_of']} (RL with another "
                                     "group sampler from its SFT weights): continue that run, or run this sampler's "
                                     "RL as a run of its own")
        results = {name: earlier_results[name] for name in reused_models(earlier_results, stage == "rl")}
        tokenizer = AutoTokenizer.from_pretrained(earlier / "base")
        model = AutoModelForCausalLM.from_pretrained(earlier / "base")
        weights = torch.load(checkpoint / "state.pt", weights_only=False)["model"]
        self._keep_base(model, tokenizer)  # so that a run started from this one finds it here
        model.load_state_dict(weights)
        model.eval()
        self._stage("reused", started, run=str(earlier), **{f"{stage}_checkpoint": checkpoint.name},
                    note=f"base model, {'RL' if stage == 'rl' else 'SFT'} weights and their held-out "
                         "evaluations from an earlier run")
        return model, tokenizer, results, earlier_report

    def _same_tasks(self, earlier: Path, setting: str) -> None:
        tasks = earlier / "tasks.jsonl"
        if not tasks.exists() or tasks.read_bytes() != (self.config.output_dir / "tasks.jsonl").read_bytes():
            raise PipelineInputError(f"{setting}: {earlier} was not run on this run's tasks (seed or task settings differ)")

    def reuse_world(self, earlier: Path) -> tuple[Any, Any, list]:
        """The base model and expert trajectories of an ``earlier`` run of the same world:
        refused unless its tasks are this run's and its base model and expert were made with
        this run's settings (``world.json``, else its report's config)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from orchard.train.credit import load_trajectories

        started = time.perf_counter()
        self._same_tasks(earlier, "world_from")
        made_with = world_of_run(earlier)
        differ = [name for name, value in world_settings(self.config).items() if made_with.get(name) != value]
        if differ:
            raise PipelineInputError(f"world_from: {earlier} made its world with other {', '.join(differ)} "
                                     "than this run's")
        if not (earlier / "base" / "config.json").is_file() or not (earlier / "expert.jsonl").is_file():
            raise PipelineInputError(f"world_from: {earlier} has no base model and expert trajectories "
                                     "(base/config.json and expert.jsonl)")
        tokenizer = AutoTokenizer.from_pretrained(earlier / "base")
        model = AutoModelForCausalLM.from_pretrained(earlier / "base").eval()
        trajectories = load_trajectories(earlier / "expert.jsonl")
        self._keep_base(model, tokenizer)
        shutil.copyfile(earlier / "expert.jsonl", self.config.output_dir / "expert.jsonl")
        self._keep_world()
        self._stage("world reused", started, run=str(earlier), trajectories=len(trajectories),
                    resolved=sum(t.resolved for t in trajectories),
                    note="base model and expert trajectories from an earlier run of this world")
        return model, tokenizer, trajectories

    def _keep_world(self) -> None:
        """Say what made this run's base model and expert data, for a run that reuses them."""
        (self.config.output_dir / "world.json").write_text(json.dumps(world_settings(self.config), indent=2))

    def _keep_base(self, model: Any, tokenizer: Any) -> None:
        """Save this run's own copy of its base model, replacing whatever ``base`` was there
        (written aside and renamed into place: never half a model, never through a link)."""
        target = self.config.output_dir / "base"
        fresh = Path(tempfile.mkdtemp(prefix=".base-", dir=self.config.output_dir))
        model.save_pretrained(fresh)
        tokenizer.save_pretrained(fresh)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        fresh.rename(target)

    def _engine(self, policy: Any, grade: bool = True) -> Any:
        from orchard.rollout.engine import EngineConfig, RolloutEngine
        from orchard.rollout.loop import RolloutConfig

        rollout = RolloutConfig(**{**self.config.rollout, "system_prompt": SYSTEM})
        return RolloutEngine(self.client, policy, EngineConfig(max_concurrent=self.config.concurrency,
                                                               rollout=rollout, grade=grade))

    def _policy(self, model: Any, tokenizer: Any, salt: int, seed: Optional[int] = None) -> Any:
        from orchard.rollout.policies.huggingface import HuggingFacePolicy

        seed = self.config.seed if seed is None else seed
        return HuggingFacePolicy(model, tokenizer, temperature=self.config.temperature, seed=seed * 101 + salt)

    async def evaluate(self, name: str, model: Any, tokenizer: Any, heldout: list) -> dict:
        from orchard.rollout.evaluation import summarize

        started = time.perf_counter()
        async with self._engine(self._policy(model, tokenizer, 1 + len(self.report["stages"]))) as engine:
            samples = await engine.run(heldout, self.config.eval_attempts, progress=self.progress)
        with open(self.config.output_dir / f"eval-{slug(name)}.jsonl", "w") as handle:
            for sample in samples:
                handle.write(json.dumps(sample.to_dict(tokens=False)) + "\n")
        report = summarize(samples, ks=(1,))
        by_level: dict[str, list[int]] = {}
        levels = {t.task_id: t.difficulty or "?" for t in heldout}
        for sample in samples:
            by_level.setdefault(levels[sample.task_id], []).append(int(sample.resolved))
        result = {"pass_rate": report["pass_rate"], "pass_rate_95": report["pass_rate_95"],
                  "attempts": report["attempts"], "statuses": report["statuses"],
                  "by_difficulty": {k: sum(v) / len(v) for k, v in sorted(by_level.items())}}
        self._stage(f"evaluate {name}", started, **{k: result[k] for k in ("pass_rate", "attempts")})
        return result

    async def expert_trajectories(self, train: list) -> list:
        from orchard.pipeline.expert import NoisyExpert, trajectory_of
        from orchard.train.credit import save_jsonl

        started = time.perf_counter()
        expert = NoisyExpert(train, seed=self.config.world, **self.config.expert)
        async with self._engine(expert) as engine:
            samples = await engine.run(train, self.config.expert_attempts, progress=self.progress)
        trajectories = [trajectory_of(s) for s in samples if s.status.value == "completed"]
        save_jsonl((t.to_dict() for t in trajectories), self.config.output_dir / "expert.jsonl")
        self._keep_world()
        self._stage("expert trajectories", started, trajectories=len(trajectories),
                    resolved=sum(t.resolved for t in trajectories))
        return trajectories

    async def credit(self, trajectories: list, train: list, sft_data: str) -> list[dict]:
        from orchard.pipeline.expert import GroundTruthValues
        from orchard.train.credit import save_jsonl
        from orchard.train.credit_pipeline import build_sft_dataset

        started = time.perf_counter()
        config = self.config
        if sft_data == "resolved":
            chosen = [t for t in trajectories if t.resolved]
            examples = (await build_sft_dataset(chosen, GroundTruthValues(train), system=SYSTEM)).examples
            self._stage("sft data", started, kind="resolved trajectories only (ablation)", examples=len(examples))
        else:
            if config.teacher:
                from orchard.train.teacher import LLMTeacher

                estimator: Any = LLMTeacher(**config.teacher)
                kind = f"LLM teacher {config.teacher.get('model')}"
            else:
                estimator, kind = GroundTruthValues(train), "ground-truth values (the tasks' known fixes), not an LLM"
            result = await build_sft_dataset(trajectories, estimator, system=SYSTEM,
                                             credit_resolved=sft_data == "credit-all")
            examples = result.examples
            self._stage("credit assignment", started, values=kind, **result.report)
        save_jsonl(examples, config.output_dir / ("sft.jsonl" if sft_data == config.sft_data else f"sft-{sft_data}.jsonl"))
        return examples

    def sft(self, model: Any, tokenizer: Any, examples: list[dict], name: str) -> None:
        from orchard.train.sft_data import tokenize_example
        from orchard.train.sft_trainer import SFTConfig, SFTTrainer

        started = time.perf_counter()
        tokenized = [tokenize_example(tokenizer, e["messages"], 2048) for e in examples]
        tokenized = [t for t in tokenized if sum(t.loss_mask[1:])]
        settings = dict(self.config.sft)
        settings["global_batch_size"] = min(settings.get("global_batch_size", 8), len(tokenized))
        settings["micro_batch_size"] = min(settings.get("micro_batch_size", 8), settings["global_batch_size"])
        while settings["global_batch_size"] % settings["micro_batch_size"]:
            settings["micro_batch_size"] -= 1
        trainer = SFTTrainer(model, tokenized, SFTConfig(output_dir=self.config.output_dir / name,
                                                         seed=self.config.seed, **settings), tokenizer.pad_token_id)
        records = trainer.train()
        model.eval()
        self._stage(name, started, examples=len(tokenized), steps=trainer.step,
                    loss_first=round(records[0]["loss"], 3) if records else None,
                    loss_last=round(records[-1]["loss"], 3) if records else None)

    def rl_config(self, name: str, sampler: str) -> "RLConfig":
        from orchard.train.rl_config import RLConfig

        return RLConfig(output_dir=self.config.output_dir / name, seed=self.config.rl_randomness,
                        **{**self.config.rl, "sampler": sampler})

    async def rl(self, model: Any, tokenizer: Any, train: list, sampler: str, name: str) -> None:
        from orchard.train.rl_trainer import RLTrainer

        started = time.perf_counter()
        config = self.rl_config(name, sampler)
        async with self._engine(self._policy(model, tokenizer, 7, self.config.rl_randomness)) as engine:
            trainer = RLTrainer(model, engine, train, config, pad_id=tokenizer.pad_token_id)
            records = await trainer.train(progress=self.progress)
        model.eval()
        self._stage(name, started, steps=trainer.step, sampler=config.sampler,
                    success_first=records[0]["success_rate"] if records else None,
                    success_last=records[-1]["success_rate"] if records else None,
                    rollouts=sum(r["rollouts"] for r in records),
                    sandbox_errors=sum(r["sandbox_errors"] for r in records))


def world_settings(config: PipelineConfig) -> dict[str, Any]:
    """What, besides the tasks, makes a run's base model and expert trajectories."""
    return json.loads(json.dumps({"world": config.world, "model": asdict(config.model), "base_model": config.base_model,
                                  "expert": config.expert, "expert_attempts": config.expert_attempts}, default=str))


def world_of_run(run_dir: Path) -> dict[str, Any]:
    """The world settings a run wrote (``world.json``), or, for a run from before that file,
    its report's config read with this version's defaults for what it does not name."""
    path = run_dir / "world.json"
    if path.exists():
        try:
            made_with = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise PipelineInputError(f"world_from: {path} cannot be read: {exc}") from None
        if not isinstance(made_with, dict):
            raise PipelineInputError(f"world_from: {path} is not an object")
        return made_with
    stored = read_report(run_dir, "world_from").get("config", {})
    try:
        config = PipelineConfig(**{k: v for k, v in stored.items() if k in PipelineConfig.__dataclass_fields__})
    except (TypeError, ValueError) as exc:
        raise PipelineInputError(f"world_from: {run_dir}/report.json has a config this version cannot read: {exc}") from None
    return world_settings(config)


def reused_models(earlier: Any, continue_rl: bool) -> list[str]:
    """Which of an ``earlier`` run's models (names) a run started from it keeps, as that run
    evaluated them: base and SFT, and with ``continue_rl`` every round of RL before this one
    (never an ablation arm: this run's arms are its own)."""
    def kept(name: str) -> bool:
        rounds = rl_rounds(name)
        return name == "base" or rounds == 0 or (continue_rl and rounds is not None)

    return [name for name in earlier if kept(name)]


def rl_arms(config: PipelineConfig, ablations: bool) -> tuple[str, list[str]]:
    """The group sampler a run trains with, and (with ``ablations``) the others it also tries."""
    sampler = config.rl.get("sampler", "bar")
    return sampler, [s for s in SAMPLERS if s != sampler] if ablations else []


ARM_SETTINGS = ("seed", "tasks", "heldout_fraction", "world_seed", "split_seed", "candidates", "rl_tasks", "rl_names",
                "rollout", "eval_attempts", "temperature")  # what RL and its evaluation saw, besides rl settings and draws


def stored_setting(settings: dict, key: str) -> Any:
    """``key`` of a stored config; one written before ``key`` existed has its default."""
    if key in settings:
        return settings[key]
    default = next(f for f in fields(PipelineConfig) if f.name == key)
    return default.default_factory() if default.default is MISSING else default.default


def arm_of(earlier: Any, config: PipelineConfig) -> bool:
    """Whether a run from the ``earlier`` run's SFT weights (its report) is an arm of it: RL
    with another group sampler and otherwise alike (the same rl settings and budget, RL tasks,
    rollout and evaluation settings), so the two stand side by side as ``--ablations`` arms
    do. Never for a continuation, nor from a run that continued RL or is an arm itself."""
    theirs = dig(earlier, "config")
    if config.continue_rl or not isinstance(theirs, dict) or theirs.get("continue_rl") or dig(earlier, "arm_of") or (
            dig(earlier, "rl_rounds") not in (None, 1)) or not isinstance(theirs.get("rl"), dict):
        return False
    ours = json.loads(json.dumps(asdict(config), default=str))

    def but_sampler(rl: dict) -> dict:
        return {k: v for k, v in rl.items() if k != "sampler"}

    def rl_draws(settings: dict) -> Any:  # ``rl_randomness`` of a stored config (before rl_seed: its seed)
        return settings.get("seed") if settings.get("rl_seed") is None else settings.get("rl_seed")

    return (theirs["rl"].get("sampler", "bar") != ours["rl"].get("sampler", "bar")
            and but_sampler(theirs["rl"]) == but_sampler(ours["rl"])
            and rl_draws(theirs) == config.rl_randomness
            and all(stored_setting(theirs, key) == ours[key] for key in ARM_SETTINGS))


def model_names(config: PipelineConfig, ablations: bool, rounds: int, earlier: Any) -> tuple[str, dict[str, str], bool]:
    """This run's RL model, its ablation arms' models (sampler -> name), and whether it is an
    arm of the ``earlier`` run it started from (``arm_of``): its model is then named for its
    sampler (``sft+rl (dapo)``), as that run's own arms are; otherwise it is the recipe's
    model of this round (``sft+rl``), whichever sampler made it."""
    sampler, others = rl_arms(config, ablations)
    recipe = rl_model(rounds)
    is_arm = earlier is not None and arm_of(earlier, config)
    return (f"{recipe} ({sampler})" if is_arm else recipe), {s: f"{recipe} ({s})" for s in others}, is_arm


def sibling_models(earlier: Any, made: set[str]) -> list[str]:
    """The first-round RL models of the run an arm run is an arm of (its recipe model and its
    own arms), carried beside the arm's; never one the arm run makes itself (``made``)."""
    results = dig(earlier, "results")
    return [name for name in (results if isinstance(results, dict) else {})
            if rl_rounds(name.partition(" (")[0]) == 1 and name not in made]


def _default_image() -> Path:
    from orchard.testing.images import local_kit_image

    return local_kit_image()


def run_pipeline(config: PipelineConfig, progress: bool = True, ablations: bool = False) -> dict[str, Any]:
    return asyncio.run(Pipeline(config, progress).run(ablations))
