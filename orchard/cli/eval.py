"""``orchard eval``: a policy on a task set, k attempts per task, pass@k, reports."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Optional

import click
import yaml
from rich.table import Table

from orchard.cli.common import api_key_option, handle_errors, out, url_option

CONFIG_KEYS = ("backend", "policy", "rollout", "sandbox", "attempts", "k", "concurrency")
PER_SANDBOX = ("image", "sandbox_id", "snapshot")  # chosen for each sandbox, never by the config


def _option_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise click.BadParameter(f"{text!r}: write KEY=VALUE")
    key, value = text.split("=", 1)
    return key, yaml.safe_load(value)  # numbers, booleans and lists read as such


def _problems(exc: Any, prefix: str) -> str:
    return "; ".join(f"{prefix}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else
                     f"{prefix}: {e['msg']}" for e in exc.errors())


def _whole(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise click.UsageError(f"--config: {key} must be a whole number >= 1, got {value!r}")
    return value


def _mapping(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(name, str) for name in value):
        raise click.UsageError(f"--config: {key} must be a mapping of names to values, got {value!r}")
    return value


def read_config(path: Optional[Path]) -> dict[str, Any]:
    """The ``--config`` file with its shape checked and normalized (``backend`` a mapping,
    ``k`` a list, the rollout and sandbox settings validated): every mistake is an error naming
    its key, never a traceback and never silently ignored."""
    from pydantic import TypeAdapter, ValidationError

    from orchard.models import SandboxSpec
    from orchard.rollout.loop import RolloutConfig

    if path is None:
        return {"backend": {}, "policy": {}, "rollout": RolloutConfig(), "sandbox": {}, "k": []}
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise click.UsageError(f"--config {path}: not a YAML file ({exc})") from None
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise click.UsageError(f"--config {path}: must be a mapping (keys {', '.join(CONFIG_KEYS)}), "
                               f"got a {type(config).__name__}")
    unknown = sorted(str(key) for key in config if key not in CONFIG_KEYS)
    if unknown:
        raise click.UsageError(f"--config: unknown key(s) {', '.join(unknown)}; known: {', '.join(CONFIG_KEYS)}")
    backend = config.get("backend")
    backend = _mapping({"name": backend} if isinstance(backend, str) else backend, "backend")
    extra = sorted(set(backend) - {"name", "settings"})
    if extra or not isinstance(backend.get("name", ""), str):
        raise click.UsageError("--config: backend must be a name or a mapping {name, settings}"
                               + (f"; unknown key(s) {', '.join(extra)}" if extra else ""))
    backend["settings"] = _mapping(backend.get("settings"), "backend.settings") or None
    config["backend"] = backend
    config["policy"] = _mapping(config.get("policy"), "policy")
    rollout = _mapping(config.get("rollout"), "rollout")
    fields = [f.name for f in dataclasses.fields(RolloutConfig)]
    unknown = sorted(set(rollout) - set(fields))
    if unknown:
        raise click.UsageError(f"--config: unknown rollout key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    try:
        config["rollout"] = TypeAdapter(RolloutConfig).validate_python(rollout)
    except ValidationError as exc:
        raise click.UsageError(f"--config: {_problems(exc, 'rollout')}") from None
    sandbox = config["sandbox"] = _mapping(config.get("sandbox"), "sandbox")
    unknown = sorted(set(sandbox) - (set(SandboxSpec.model_fields) - set(PER_SANDBOX)))
    if unknown:
        known = sorted(set(SandboxSpec.model_fields) - set(PER_SANDBOX))
        why = "is chosen for each sandbox" if unknown[0] in PER_SANDBOX else "is not a sandbox setting"
        raise click.UsageError(f"--config: sandbox.{unknown[0]} {why}; the settings are {', '.join(known)}")
    try:
        SandboxSpec(**sandbox)
    except ValidationError as exc:
        raise click.UsageError(f"--config: {_problems(exc, 'sandbox')}") from None
    for key in ("attempts", "concurrency"):
        if key in config:
            config[key] = _whole(config[key], key)
    k = config.get("k")
    config["k"] = [_whole(value, "k") for value in (k if isinstance(k, list) else [] if k is None else [k])]
    return config


@click.command("eval")
@click.argument("tasks_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML: backend {name, settings}, policy {kind, ...}, rollout {...}, sandbox {...}, attempts, k, "
                   "concurrency (flags override it)")
@click.option("--policy", "policy_kind", default=None, help="oracle | scripted | huggingface | openai")
@click.option("--policy-option", "policy_options", multiple=True, help="KEY=VALUE for the policy (repeatable)")
@click.option("--split", default=None, help="only tasks of this split (e.g. heldout)")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="only the first N tasks")
@click.option("--attempts", type=click.IntRange(min=1), default=None,
              help="attempts per task (n of pass@k; default 1)")
@click.option("-k", "ks", type=click.IntRange(min=1), multiple=True,
              help="report pass@k (repeatable; default 1 and attempts)")
@click.option("--concurrency", type=click.IntRange(min=1), default=None, help="rollout sandboxes at once (default 16)")
@click.option("--backend", default=None, help="backend name (default: the config's, else local)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="write report.json, report.md and samples.jsonl here")
@click.option("--progress/--no-progress", default=True)
@url_option
@api_key_option
@handle_errors
def evaluate(tasks_file: Path, config_file: Optional[Path], policy_kind: Optional[str], policy_options: tuple[str, ...],
             split: Optional[str], limit: Optional[int], attempts: Optional[int], ks: tuple[int, ...],
             concurrency: Optional[int], backend: Optional[str], out_dir: Optional[Path], progress: bool,
             url: Optional[str], api_key: Optional[str]) -> None:
    """Run a policy on every task of TASKS_FILE and report pass@k (any backend)."""
    from orchard.rollout.evaluation import left_out_text, markdown, summarize, write_report
    from orchard.tasks import load_tasks

    config = read_config(config_file)
    try:
        tasks = [t for t in load_tasks(tasks_file) if split is None or t.split == split][:limit]
    except UnicodeDecodeError as exc:
        raise click.UsageError(f"{tasks_file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not tasks:
        raise click.UsageError(f"no tasks in {tasks_file}" + (f" with split {split!r}" if split else ""))
    policy_settings = {**config.get("policy", {}), **dict(map(_option_value, policy_options))}
    kind = policy_kind or policy_settings.pop("kind", None)
    policy_settings.pop("kind", None)
    if kind is None:
        raise click.UsageError("say which policy: --policy KIND or policy.kind in --config")
    from orchard.rollout.policies.factory import POLICY_KINDS

    if kind != "oracle" and kind not in POLICY_KINDS:
        raise click.UsageError(f"unknown policy {kind!r}: one of {', '.join(sorted({'oracle', *POLICY_KINDS}))}")
    attempts = attempts or config.get("attempts", 1)
    ks = tuple(sorted(set(ks or config["k"] or (1, attempts))))
    concurrency = concurrency or config.get("concurrency", 16)
    samples, metrics = asyncio.run(_run(tasks, kind, policy_settings, attempts, concurrency,
                                        backend or config["backend"].get("name", "local"),
                                        config["backend"]["settings"], config, url, api_key, progress))
    report = summarize(samples, ks)
    report["engine"] = metrics
    title = f"orchard eval {tasks_file.name}: policy {kind}, {attempts} attempt(s) per task"
    if out_dir:
        write_report(report, samples, out_dir, title)
    table = Table("metric", "value", title=title)
    low, high = report["pass_rate_95"]
    low_all, high_all = report["pass_rate_all_95"]
    table.add_row("tasks / valid attempts / all", f"{report['tasks']} / {report['attempts']} / "
                                                  f"{report['attempts_all']}")
    table.add_row("pass rate (95% interval)", f"{report['pass_rate']:.3f} ({low:.3f}-{high:.3f})")
    table.add_row("pass rate, aborted and timed out as failures",
                  f"{report['pass_rate_all']:.3f} ({low_all:.3f}-{high_all:.3f})")
    for name, value in report["pass_at_k"].items():
        table.add_row(name, f"{value:.3f}")
    for name, left_out in report["pass_at_k_left_out"].items():
        table.add_row(name, left_out_text(name, left_out))
    table.add_row("statuses", ", ".join(f"{k} {v}" for k, v in sorted(report["statuses"].items())))
    table.add_row("rollouts/s", str(metrics["rollouts_per_second"]))
    out.print(table)
    for warning in report["warnings"]:
        out.print(f"[yellow]warning[/yellow]: {warning}")
    if out_dir:
        out.print(f"reports in {out_dir} (report.md, report.json, samples.jsonl)")
    elif not progress:
        out.print(markdown(report, title))
    if not report["attempts"]:
        causes = ", ".join(f"{kind} {count}" for kind, count in sorted(metrics["failures"].items())) or "none given"
        raise click.ClickException(f"no valid attempt: all {report['attempts_all']} were aborted "
                                   f"(the environment failed: {causes})")


def _policy(kind: str, settings: dict[str, Any], tasks: list) -> Any:
    if kind == "oracle":
        from orchard.rollout.policies.oracle import NoisyOraclePolicy

        return NoisyOraclePolicy(tasks, float(settings.pop("p", 1.0)), settings.pop("seed", None), **settings)
    from orchard.rollout.policies.factory import build_policy

    return build_policy(kind, **settings)


async def _run(tasks: list, kind: str, policy_settings: dict[str, Any], attempts: int, concurrency: int,
               backend: str, backend_settings: Optional[dict], config: dict[str, Any], url: Optional[str],
               api_key: Optional[str], progress: bool) -> tuple[list, dict]:
    from orchard.client.aio import AsyncClient
    from orchard.rollout.engine import EngineConfig, RolloutEngine

    try:
        policy = _policy(kind, policy_settings, tasks)
    except (TypeError, ValueError) as exc:  # a setting the policy does not take, or a bad value
        raise click.UsageError(f"policy {kind!r}: {exc}") from None
    engine_config = EngineConfig(max_concurrent=concurrency, rollout=config["rollout"], sandbox=config["sandbox"])
    try:
        async with AsyncClient(url, api_key, backend=None if url else backend,
                               backend_settings=None if url else backend_settings) as client:
            async with RolloutEngine(client, policy, engine_config) as engine:
                samples = await engine.run(tasks, attempts, progress=progress)
                return samples, engine.metrics.summary()
    finally:
        await policy.close()
