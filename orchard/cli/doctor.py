"""``orchard doctor [--backend NAME]``: can this machine run that backend, and if not, what fixes it.

The checks come from the backend class itself (``Backend.doctor``), so a third-party
backend brings its own and core knows none of them. Exit code 0 only when every required
check passed; 1 when the backend cannot run here; 2 for an unknown backend or bad settings file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import click
from pydantic import ValidationError

from orchard.backends.checks import Check, can_run
from orchard.cli.common import json_option, out, print_json


def read_settings(path: Optional[str]) -> dict[str, Any]:
    """The backend's settings from a YAML/JSON file: either the settings themselves or
    ``{backend: {name, settings}}`` as in ``orchard serve``'s config."""
    if not path:
        return {}
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path} must hold a mapping of settings", param_hint="--settings")
    backend = data.get("backend")
    if isinstance(backend, dict) and "settings" in backend:
        return dict(backend.get("settings") or {})
    return data


def settings_check(cls: type, settings: dict[str, Any]) -> Check:
    """The settings as the backend's own config model reads them (a typo is named here, not at start)."""
    try:
        cls.config_model(**settings)
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return Check("settings", False, detail, "correct the settings named above")
    return Check("settings", True, "valid" if settings else "defaults")


def print_report(name: str, checks: list[Check]) -> None:
    """One line per check; a failure's fix on the line below it, whole, to copy."""
    out.print(f"orchard doctor: backend {name}")
    for check in checks:
        mark = "[green]ok      [/green]" if check.ok else (
            "[red]MISSING [/red]" if check.required else "[yellow]optional[/yellow]")
        out.print(f"  {mark} {check.name}: {check.detail}", markup=True, highlight=False, soft_wrap=True)
        if not check.ok and check.fix:
            out.print(f"           fix: {check.fix}", markup=False, highlight=False, soft_wrap=True)
    if can_run(checks):
        out.print(f"[green]backend {name} can run on this machine[/green]")
    else:
        count = sum(1 for c in checks if c.required and not c.ok)
        out.print(f"[red]backend {name} cannot run here[/red]: {count} required check(s) failed; run the fixes above")


@click.command()
@click.option("--backend", "name", envvar="ORCHARD_BACKEND", default="local", show_default=True,
              help="the backend to check for")
@click.option("--settings", "settings_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="YAML/JSON file of the backend's settings (or an `orchard serve` config)")
@json_option
def doctor(name: str, settings_file: Optional[str], as_json: bool) -> None:
    """Check this machine for a backend and print what is missing with the command that fixes it."""
    from orchard.plugins import collect

    backends = collect("orchard_register_backends")
    if name not in backends:
        raise click.BadParameter(f"unknown backend {name!r}; installed: {', '.join(sorted(backends))}",
                                 param_hint="--backend")
    cls = backends[name]
    settings = read_settings(settings_file)
    checks = [settings_check(cls, settings), *cls.doctor(settings)]
    if as_json:
        print_json({"backend": name, "ok": can_run(checks), "checks": [c.to_dict() for c in checks]})
    else:
        print_report(name, checks)
    sys.exit(0 if can_run(checks) else 1)
