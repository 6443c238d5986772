"""``orchard eval``: a policy on a task set, k attempts per task, pass@k, reports."""

from __future__ import annotations

import asyncio

from pathlib import Path
from typing import Any, Optional

import click
import yaml
from rich.table import Table

from orchard.cli.common import api_key_option, handle_errors, out, url_option


def _option_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise click.BadParameter(f"{text!r}: write KEY=VALUE")
    key, value = text.split("=", 1)
    return key, yaml.safe_load(value)  # numbers, booleans and lists read as such


@click.command("eval")
@click.argument("tasks_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML: backend {name, settings}, policy {kind, ...}, rollout {...}, sandbox {...}, attempts, k, "
                   "concurrency (flags override it)")
@click.option("--policy", "policy_kind", default=None, help="oracle | scripted | huggingface | openai")
@click.option("--policy-option", "policy_options", multiple=True, help="KEY=VALUE for the policy (repeatable)")
@click.option("--split", default=None, help="only tasks of this split (e.g. heldout)")
@click.option("--limit", type=int, default=None, help="only the first N tasks")
@click.option("--attempts", type=int, default=None, help="attempts per task (n of pass@k; default 1)")
@click.option("-k", "ks", type=int, multiple=True, help="report pass@k (repeatable; default 1 and attempts)")
@click.option("--concurrency", type=int, default=None, help="rollout sandboxes at once (default 16)")
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
    from orchard.rollout.evaluation import markdown, summarize, write_report
    from orchard.tasks import load_tasks

    config: dict[str, Any] = yaml.safe_load(config_file.read_text()) or {} if config_file else {}
    tasks = [t for t in load_tasks(tasks_file) if split is None or t.split == split][:limit]
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
    attempts = attempts or int(config.get("attempts", 1))
    ks = tuple(sorted(set(ks or config.get("k", ()) or (1, attempts))))
    backend_config = config.get("backend", {})
    samples, metrics = asyncio.run(_run(tasks, kind, policy_settings, attempts,
                                        concurrency or int(config.get("concurrency", 16)),
                                        backend or backend_config.get("name", "local"),
                                        backend_config.get("settings"), config, url, api_key, progress))
    report = summarize(samples, ks)
    report["engine"] = metrics
    title = f"orchard eval {tasks_file.name}: policy {kind}, {attempts} attempt(s) per task"
    if out_dir:
        write_report(report, samples, out_dir, title)
    table = Table("metric", "value", title=title)
    low, high = report["pass_rate_95"]
    table.add_row("tasks / attempts", f"{report['tasks']} / {report['attempts']}")
    table.add_row("pass rate (95% interval)", f"{report['pass_rate']:.3f} ({low:.3f}-{high:.3f})")
    for name, value in report["pass_at_k"].items():
        table.add_row(name, f"{value:.3f}")
    table.add_row("statuses", ", ".join(f"{k} {v}" for k, v in sorted(report["statuses"].items())))
    table.add_row("rollouts/s", str(metrics["rollouts_per_second"]))
    out.print(table)
    if out_dir:
        out.print(f"reports in {out_dir} (report.md, report.json, samples.jsonl)")
    elif not progress:
        out.print(markdown(report, title))


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
    from orchard.rollout.loop import RolloutConfig

    try:
        policy = _policy(kind, policy_settings, tasks)
    except (TypeError, ValueError) as exc:  # a setting the policy does not take, or a bad value
        raise click.UsageError(f"policy {kind!r}: {exc}") from None
    rollout = RolloutConfig(**config.get("rollout", {}))
    engine_config = EngineConfig(max_concurrent=concurrency, rollout=rollout, sandbox=config.get("sandbox", {}))
    try:
        async with AsyncClient(url, api_key, backend=None if url else backend,
                               backend_settings=None if url else backend_settings) as client:
            async with RolloutEngine(client, policy, engine_config) as engine:
                samples = await engine.run(tasks, attempts, progress=progress)
                return samples, engine.metrics.summary()
    finally:
        await policy.close()



