"""``orchard bench``: benchmark commands whose figures go into docs/benchmarks.md."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import click
from rich.table import Column, Table

from orchard.cli.common import PluginGroup, api_key_option, backend_option, handle_errors, out, url_option


@click.group(cls=PluginGroup)
def bench() -> None:
    """Benchmarks (results as a table and as JSON)."""


@bench.command("sandboxes")
@click.option("-n", "--sandboxes", type=int, default=100, show_default=True)
@click.option("-m", "--commands", type=int, default=1, show_default=True, help="commands per sandbox")
@click.option("-c", "--concurrency", type=int, default=32, show_default=True)
@click.option("--command", default="true", show_default=True)
@click.option("--image", default="host", show_default=True)
@click.option("--latency-samples", type=int, default=200, show_default=True,
              help="sequential execs in one sandbox after the load, for idle p50/p99")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@click.option("--direct", is_flag=True, help="with --url: exec and files straight to the agents (the hot path)")
@url_option
@api_key_option
@backend_option
@handle_errors
def sandboxes(sandboxes: int, commands: int, concurrency: int, command: str, image: str, latency_samples: int,
              output: Optional[Path], direct: bool, url: Optional[str], api_key: Optional[str], backend: str) -> None:
    """Create N sandboxes concurrently, run M commands in each, delete them."""
    from orchard.bench.sandboxes import run

    result = with_client(url, api_key, backend,
                         lambda client: run(client, sandboxes, commands, concurrency, command, image, latency_samples),
                         direct=direct)
    report(result, f"orchard bench sandboxes -n {sandboxes} -m {commands} -c {concurrency}", output)
    for failure in result["failures"]:
        out.print(f"[red]failure[/red] {failure}")
    if result["succeeded"] != sandboxes:
        raise SystemExit(1)


@bench.command("forks")
@click.option("--image", default=None, help="a directory or docker:// image with git (default: one built from "
                                            "this machine's packages into the agent's rootfs directory)")
@click.option("--setup", default=None, help="the setup a fresh sandbox runs (default: a 200-file git repository)")
@click.option("--samples", type=int, default=20, show_default=True, help="fresh sandboxes and single forks timed")
@click.option("-n", "--forks", type=int, default=64, show_default=True, help="forks of one snapshot made at once")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@url_option
@api_key_option
@backend_option
@handle_errors
def forks(image: Optional[str], setup: Optional[str], samples: int, forks: int, output: Optional[Path],
          url: Optional[str], api_key: Optional[str], backend: str) -> None:
    """A prepared sandbox forked (copy-on-write) versus a fresh sandbox plus setup."""
    from orchard.bench.forks import DEFAULT_SETUP, run

    image = image or str(default_image())
    result = with_client(url, api_key, backend, lambda client: run(client, image, setup or DEFAULT_SETUP, samples,
                                                                  forks))
    report(result, f"orchard bench forks --samples {samples} -n {forks}", output)


@bench.command("rollouts")
@click.option("-n", "--rollouts", type=int, default=64, show_default=True)
@click.option("--turns", type=int, default=20, show_default=True, help="commands per rollout before it submits")
@click.option("-c", "--concurrency", type=int, default=32, show_default=True)
@click.option("--command", default="true", show_default=True, help="what each turn runs")
@click.option("--image", default=None, help="a directory or docker:// image with python3 and git (default: built)")
@click.option("--profile", type=click.Path(dir_okay=False), default=None, help="write a cProfile summary here")
@click.option("--grade/--no-grade", default=True, show_default=True, help="grade each rollout (a fresh fork + tests)")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@url_option
@api_key_option
@backend_option
@handle_errors
def rollouts(rollouts: int, turns: int, concurrency: int, command: str, image: Optional[str], profile: Optional[str],
             grade: bool, output: Optional[Path], url: Optional[str], api_key: Optional[str], backend: str) -> None:
    """Rollout-engine overhead: an instant policy, real commands, turns per second (grading included)."""
    from orchard.bench.rollouts import run

    image = image or str(default_image())
    result = with_client(url, api_key, backend,
                         lambda client: run(client, image, rollouts, turns, concurrency, command, profile, grade))
    report(result, f"orchard bench rollouts -n {rollouts} --turns {turns} -c {concurrency}", output)


def default_image() -> Path:
    from orchard.testing.images import local_kit_image

    return local_kit_image()


def with_client(url: Optional[str], api_key: Optional[str], backend: str,
                work: Callable[[Any], Awaitable[dict]], **options: Any) -> dict:
    """Run ``work(client)`` on an AsyncClient (the server at ``url``, else ``backend`` in process)."""
    from orchard.client.aio import AsyncClient

    async def main() -> dict:
        async with AsyncClient(url, api_key, backend=None if url else backend, **options) as client:
            return await work(client)

    return asyncio.run(main())


def report(result: dict, title: str, output: Optional[Path]) -> None:
    table = Table("metric", "value", title=title)
    for key, value in result.items():
        if key != "failures":
            table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    out.print(table)
    if output:
        output.write_text(json.dumps(result, indent=2))


@bench.command("noisy")
@click.option("--quiet", type=int, default=4, show_default=True, help="sandboxes running `true` in a loop")
@click.option("--flood-mb", type=int, default=1000, show_default=True, help="stdout flood of one neighbour")
@click.option("--upload-mb", type=int, default=100, show_default=True, help="upload of another neighbour")
@click.option("--rounds", type=int, default=5, show_default=True, help="times the noise is repeated")
@click.option("--output", type=click.Path(path_type=Path), default=None)
@url_option
@api_key_option
@backend_option
@handle_errors
def noisy(quiet: int, flood_mb: int, upload_mb: int, rounds: int, output: Optional[Path], url: Optional[str],
          api_key: Optional[str], backend: str) -> None:
    """Exec latency of quiet sandboxes while one floods output and one uploads a large file."""
    from orchard.bench.noisy import run

    report(with_client(url, api_key, backend, lambda client: run(client, quiet, flood_mb * 10**6,
                                                                 upload_mb * 10**6, rounds)), f"orchard bench noisy --quiet {quiet} --flood-mb {flood_mb} --upload-mb {upload_mb} "
            f"--rounds {rounds}", output)


@bench.command("files")
@click.option("--samples", type=int, default=200, show_default=True, help="sequential calls of each kind")
@click.option("--size", type=int, default=1024, show_default=True, help="bytes uploaded and downloaded")
@click.option("--output", type=click.Path(path_type=Path), default=None)
@url_option
@api_key_option
@backend_option
@handle_errors
def files(samples: int, size: int, output: Optional[Path], url: Optional[str], api_key: Optional[str],
          backend: str) -> None:
    """Latency of upload, download and list (each run inside the sandbox) next to exec true's."""
    from orchard.bench.files import run

    report(with_client(url, api_key, backend, lambda client: run(client, samples, size)), f"orchard bench files --samples {samples} --size {size}", output)


@bench.command("bar")
@click.option("--seeds", type=int, default=5, show_default=True)
@click.option("--steps", type=int, default=None, help="optimizer steps per run (default: SimulationParams)")
@click.option("--group-size", type=int, default=None, help="G (default: SimulationParams)")
@click.option("--max-rollouts", type=int, default=None, help="N_max (default: SimulationParams)")
@click.option("--strides", default=None, help="BAR's strides, comma-separated (default: SimulationParams)")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="write a PNG here")
@handle_errors
def bar(seeds: int, steps: Optional[int], group_size: Optional[int], max_rollouts: Optional[int],
        strides: Optional[str], output: Optional[Path], plot_path: Optional[Path]) -> None:
    """Simulated GRPO training: fixed-G, DAPO, prefilter, downsample, static and adaptive BAR."""
    from dataclasses import replace

    from orchard.bench.bar import SimulationParams, plot, run

    changes: dict[str, Any] = {"steps": steps, "group_size": group_size, "max_rollouts": max_rollouts,
                               "strides": tuple(int(s) for s in strides.split(",")) if strides else None}
    params = replace(SimulationParams(), **{k: v for k, v in changes.items() if v is not None})
    result = run(seeds, params)
    title = (f"orchard bench bar --seeds {seeds}: G={params.group_size}, N_max={params.max_rollouts}, "
             f"{params.steps} steps; held-out pass rate (%) starts at {100 * result['held_out_start']:.1f}")
    table = Table(Column("method", no_wrap=True), "held-out @ equal sandbox-h", "@ equal wall-clock", "@ equal steps",
                  "rollouts/step", "p95 | max", "wall min/step", "p95 | max", "prompts/step", "zero-adv share",
                  title=title)

    def cell(value: Optional[dict], scale: float = 1.0, digits: int = 1) -> str:
        return "-" if value is None else f"{value['mean'] * scale:.{digits}f} ± {value['std'] * scale:.{digits}f}"

    for method, s in result["summary"].items():
        p95_max = f"{s['rollouts_per_step_p95']['mean']:.0f} | {s['rollouts_per_step_max']['mean']:.0f}"
        wall_p95_max = (f"{s['wall_clock_per_step_p95_s']['mean'] / 60:.0f} | "
                        f"{s['wall_clock_per_step_max_s']['mean'] / 60:.0f}")
        table.add_row(method, cell(s["held_out_at_equal_sandbox_time"], 100),
                      cell(s["held_out_at_equal_wall_clock"], 100), cell(s["held_out_at_equal_steps"], 100),
                      cell(s["rollouts_per_step"]), p95_max, cell(s["wall_clock_per_step_s"], 1 / 60), wall_p95_max,
                      cell(s["prompts_per_step"]), cell(s["zero_advantage_share"], 1.0, 3))
    out.print(table)
    out.print(f"equal budgets: {result['sandbox_budget_hours']:.0f} sandbox-hours, "
              f"{result['wall_budget_hours']:.1f} wall-clock hours (the least any method spent, mean over seeds)")
    for metric, method in result["winners"].items():
        out.print(f"best {metric}: {method}")
    for pair, deltas in result["paired"].items():
        out.print(f"{pair} (per seed): held-out {cell(deltas['held_out_at_equal_sandbox_time'], 100)} pts at equal "
                  f"sandbox-h, {cell(deltas['held_out_at_equal_wall_clock'], 100)} at equal wall-clock, "
                  f"{cell(deltas['held_out_at_equal_steps'], 100)} at equal steps; rollouts/step "
                  f"{cell(deltas['rollouts_per_step'])}, wall min/step {cell(deltas['wall_clock_per_step_s'], 1 / 60)}")
    if output:
        output.write_text(json.dumps(result, indent=2))
    if plot_path:
        plot(result, str(plot_path))


@bench.command("bundle")
@click.option("--bundle", "bundle_dir", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="an existing bundle (default: build one in a temporary directory)")
@click.option("--runs", type=int, default=10, show_default=True, help="agent starts to time")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@handle_errors
def bundle(bundle_dir: Optional[Path], runs: int, output: Optional[Path]) -> None:
    """Agent bundle: size, and time from exec of its launcher to a healthy agent."""
    from orchard.bench.bundle import run_bundle_bench

    report(run_bundle_bench(bundle_dir, runs), "agent bundle", output)


@bench.command("session")
@click.option("--image", default="host", show_default=True, help="an image with bash")
@click.option("--samples", type=int, default=1000, show_default=True, help="commands timed, one after another")
@click.option("--command", default="echo hi", show_default=True)
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@click.option("--direct", is_flag=True, help="with --url: the terminal straight to the agent")
@url_option
@api_key_option
@backend_option
@handle_errors
def session(image: str, samples: int, command: str, output: Optional[Path], direct: bool, url: Optional[str],
            api_key: Optional[str], backend: str) -> None:
    """Round trip of a command in a persistent shell session (p50 target: 10 ms)."""
    from orchard.bench.session import run

    result = with_client(url, api_key, backend, lambda client: run(client, image, samples, command), direct=direct)
    report(result, f"orchard bench session --samples {samples}", output)


@bench.command("compare")
@click.option("--targets", default="orchard,orchard-direct,orchard-server,swerex-local,swerex-remote", show_default=True,
              help="comma-separated: orchard (SDK in process), orchard-direct (made through `orchard serve`, "
                   "commands straight to the agent), orchard-server (through `orchard serve`), "
                   "swerex-local, swerex-remote (sh -c), swerex-remote-bash (bash -c, as Orchard runs commands), "
                   "swerex-remote-session (a persistent bash, SWE-agent's way)")
@click.option("-n", "--sandboxes", type=int, default=1, show_default=True,
              help="sandboxes per target (SWE-ReX: bash sessions)")
@click.option("-m", "--commands", type=int, default=300, show_default=True, help="`true` commands per target")
@click.option("--python-commands", type=int, default=100, show_default=True,
              help="small Python commands per target")
@click.option("--chunk", type=int, default=25, show_default=True, help="commands of one target before the next")
@click.option("--image", default="host", show_default=True)
@click.option("--spawner/--no-spawner", default=True, show_default=True,
              help="Orchard's agent forks commands from the sandbox's holder (else one orchard-enter each)")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="the agent's state directory (default: a fresh one, removed afterwards)")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@handle_errors
def compare(targets: str, sandboxes: int, commands: int, python_commands: int, chunk: int, image: str,
            spawner: bool, state_dir: Optional[Path], output: Optional[Path]) -> None:
    """Orchard and SWE-ReX side by side in one run: p50/p99, commands/s, ratios to SWE-ReX remote."""
    from orchard.bench.compare import run

    names = [name.strip() for name in targets.split(",") if name.strip()]
    result = asyncio.run(run(names, sandboxes, commands, python_commands, max(1, chunk), image, spawner, state_dir))
    title = (f"orchard bench compare -n {sandboxes} -m {commands} --python-commands {python_commands}"
             f"{'' if spawner else ' --no-spawner'}")
    table = Table("target", "true p50 ms", "true p99 ms", "python p50 ms", "python p99 ms", "commands/s",
                  "setup s", "ratio true / python", "CPU ms/cmd client / server", title=title)
    ratios = result.get("ratio_to_swerex_remote", {})
    for name in names:
        entry = result[name]
        ratio = ratios.get(name, {})
        table.add_row(name, str(entry["true"]["p50_ms"]), str(entry["true"]["p99_ms"]), str(entry["python"]["p50_ms"]),
                      str(entry["python"]["p99_ms"]), str(entry["commands_per_s"]), str(entry["setup_s"]),
                      f"{ratio.get('true', '-')} / {ratio.get('python', '-')}" if ratio else "-",
                      f"{entry['cpu_ms_per_command']['client']} / {entry['cpu_ms_per_command']['server']}")
    out.print(table)
    for key, ratios in result.items():  # the ratios to the other SWE-ReX ways, where they ran
        if key.startswith("ratio_to_") and key != "ratio_to_swerex_remote":
            out.print(f"{key}: " + ", ".join(f"{name} {r.get('true', '-')} / {r.get('python', '-')}"
                                             for name, r in ratios.items()))
    out.print(f"load average before/after: {result['load_average']}")
    if output:
        output.write_text(json.dumps(result, indent=2))
