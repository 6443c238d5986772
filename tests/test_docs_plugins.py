"""docs/plugins.md cannot drift (datasette's test_docs): every hook is there with its exact
signature, and every method a backend may implement is named."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from orchard import hookspecs
from orchard.backends.api import Backend

DOCS = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()


def hook_names() -> list[str]:
    return [name for name, value in vars(hookspecs).items() if name.startswith("orchard_") and callable(value)]


def test_every_hook_is_documented_with_its_signature():
    names = hook_names()
    assert len(names) >= 5
    for name in names:
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert f"`{name}({params})`" in DOCS, f"docs/plugins.md lacks `{name}({params})`"


def test_no_documented_hook_is_gone():
    documented = set(re.findall(r"`(orchard_[a-z_]+)\(", DOCS))
    assert documented <= set(hook_names()), f"documented but not in hookspecs: {documented - set(hook_names())}"


def test_every_backend_method_is_named():
    for name, value in vars(Backend).items():
        function = value.__func__ if isinstance(value, classmethod) else value
        if name.startswith("_") or not inspect.isfunction(function) or name in {"from_settings", "refuse"}:
            continue  # from_settings and refuse are helpers a backend calls, not implements
        params = ", ".join(p for p in inspect.signature(function).parameters if p not in ("self", "cls"))
        assert f"`{name}({params})`" in DOCS, f"docs/plugins.md lacks Backend `{name}({params})`"
