"""``orchard tasks``: generate, convert and inspect task files (JSONL, one task per line)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import click
from rich.markup import escape
from rich.table import Column, Table

from orchard.cli.common import handle_errors, json_option, out, print_json


def _say(text: str) -> None:
    """One plain line (paths may hold '[', which rich would read as markup; no wrapping)."""
    out.print(text, markup=False, highlight=False, soft_wrap=True)


@click.group()
def tasks() -> None:
    """Software-engineering tasks for rollouts: generated suites and SWE-bench instances."""


@tasks.command("generate")
@click.option("--n", "n", type=click.IntRange(min=0), required=True, help="how many tasks")
@click.option("--seed", type=int, default=0, show_default=True, help="same seed, same tasks")
@click.option("--image", default="host", show_default=True,
              help="sandbox image with python3 and git: 'host', a directory, or docker://REF")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="the JSONL file to write")
@click.option("--heldout-fraction", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.2,
              show_default=True, help="share of tasks from held-out bug variants (split 'heldout')")
@click.option("--workdir", default="/workspace", show_default=True, help="repository path in the sandbox")
@click.option("--split-seed", type=int, default=None,
              help="hold out the variants this seed picks (default: --seed's), as a pipeline's split_seed does")
@handle_errors
def generate(n: int, seed: int, image: str, out_path: Path, heldout_fraction: float, workdir: str,
             split_seed: Optional[int]) -> None:
    """Write N seeded bug-fixing tasks (small Python repositories with unittest suites)."""
    from orchard.tasks import generate_suite, save_tasks

    suite = generate_suite(n, seed, image, heldout_fraction=heldout_fraction, workdir=workdir, split_seed=split_seed)
    save_tasks(suite, out_path)
    splits = Counter(task.split for task in suite)
    _say(f"wrote {len(suite)} tasks to {out_path} "
         f"({', '.join(f'{count} {name}' for name, count in sorted(splits.items())) or 'none'})")


@tasks.command("convert")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--source", type=click.Choice(["swe-bench", "swe-rebench"]), default="swe-bench", show_default=True)
@click.option("--namespace", default=None, help="image registry namespace (default: the source's own)")
@click.option("--split", default=None, help="split of the tasks (default: test for SWE-bench, train for SWE-rebench)")
@click.option("--skip-unsupported", is_flag=True, help="skip instances no parser here can grade")
@handle_errors
def convert(path: Path, out_path: Path, source: str, namespace: Optional[str], split: Optional[str],
            skip_unsupported: bool) -> None:
    """Convert a SWE-bench or SWE-rebench instance file (JSONL) into a task file."""
    from orchard.tasks import load_swebench, load_swerebench, save_tasks

    loader = load_swerebench if source == "swe-rebench" else load_swebench
    options = {"split": split} if split else {}
    converted = loader(path, namespace=namespace, skip_unsupported=skip_unsupported, **options)
    save_tasks(converted, out_path)
    _say(f"wrote {len(converted)} tasks to {out_path}")


def _family(task) -> str:
    return str(task.metadata.get("family") or (task.tags[0] if task.tags else ""))


@tasks.command("show")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@json_option
@handle_errors
def show(path: Path, as_json: bool) -> None:
    """List the tasks of a JSONL file: id, family, difficulty, split."""
    from orchard.tasks import load_tasks

    loaded = load_tasks(path)
    rows = [{"task_id": t.task_id, "family": _family(t), "difficulty": t.difficulty, "split": t.split,
             "fail_to_pass": len(t.fail_to_pass), "pass_to_pass": len(t.pass_to_pass)} for t in loaded]
    if as_json:
        print_json(rows)
        return
    table = Table(Column("id", no_wrap=True), "family", "difficulty", "split", "f2p", "p2p",
                  title=f"{escape(str(path))} ({len(rows)} tasks)")
    for row in rows:
        cells = [row["task_id"], row["family"], row["difficulty"] or "-", row["split"]]
        table.add_row(*map(escape, cells), str(row["fail_to_pass"]), str(row["pass_to_pass"]))
    out.print(table)
