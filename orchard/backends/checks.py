"""What ``orchard doctor`` reports: one :class:`Check` per thing a backend needs on this machine.

Backends contribute their own checks (``Backend.doctor``), so core holds no per-backend
knowledge; the probes here are the generic pieces they share (is a tool on PATH, does a
command answer in time, does a Python module import). Every failed check carries the
command that fixes it, because "bwrap: missing" alone leaves the user searching.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class Check:
    """One finding: ``ok`` or not, what was seen, and the command that fixes a failure.

    ``required=False`` marks what only some uses need (docker:// images, one of several
    container runtimes): reported, but the backend can still run without it.
    """

    name: str
    ok: bool
    detail: str = ""
    fix: Optional[str] = None
    required: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def can_run(checks: Sequence[Check]) -> bool:
    """True when every required check passed: the backend can run here."""
    return all(check.ok for check in checks if check.required)


def tool_check(tool: str, fix: str, *, why: str = "", required: bool = True) -> Check:
    """Is ``tool`` on PATH? ``fix`` is the install command (``apt-get install ...``)."""
    path = shutil.which(tool)
    detail = path or f"{tool} not found on PATH" + (f" ({why})" if why else "")
    return Check(tool, path is not None, detail, None if path else fix, required)


def tools_check(name: str, tools: Sequence[str], fix: str, *, why: str = "", required: bool = True) -> Check:
    """Are all of ``tools`` on PATH? One finding for a set that comes in one package."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if not missing:
        return Check(name, True, ", ".join(tools) + " found", None, required)
    detail = f"not found on PATH: {', '.join(missing)}" + (f" ({why})" if why else "")
    return Check(name, False, detail, fix, required)


def module_check(module: str, fix: str, *, required: bool = True) -> Check:
    """Does the Python module ``module`` import here (found, without importing it)?"""
    found = importlib.util.find_spec(module) is not None
    return Check(f"python: {module}", found, "importable" if found else f"{module} is not installed",
                 None if found else fix, required)


def probe(argv: Sequence[str], timeout: float = 15.0) -> tuple[bool, str]:
    """Run a short command; (exit code 0, its output's last line). Bounded by ``timeout``,
    so a hung ``sinfo`` or socket makes a failed check, never a hung doctor."""
    if shutil.which(argv[0]) is None:
        return False, f"{argv[0]} not found on PATH"
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"{' '.join(argv)} did not answer within {timeout:g} s"
    except OSError as exc:
        return False, f"{' '.join(argv)}: {exc}"
    text = (result.stdout + result.stderr).strip()
    last = text.splitlines()[-1] if text else ""
    return result.returncode == 0, last if result.returncode == 0 else (last or f"exit code {result.returncode}")


def probe_check(name: str, argv: Sequence[str], fix: str, *, timeout: float = 15.0,
                required: bool = True) -> Check:
    """A check that passes when ``argv`` exits 0 within ``timeout``."""
    ok, detail = probe(argv, timeout)
    return Check(name, ok, detail or "ok", None if ok else fix, required)
