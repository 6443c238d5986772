"""Finding an installed backend by name and building it from its settings: one place for
the SDK, the CLI and the server, so a bad setting reads the same everywhere."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationError

from orchard.backends.api import Backend
from orchard.errors import InvalidRequest
from orchard.plugins import collect


def load_backend(name: str = "local", settings: Optional[dict[str, Any]] = None,
                 prefix: str = "backend.settings") -> Backend:
    """The backend ``name`` with its own validated config; a bad setting is an
    InvalidRequest naming the key (``backend.settings.url: ...``)."""
    backends = collect("orchard_register_backends")
    if name not in backends:
        raise InvalidRequest(f"backend.name: unknown backend {name!r}; installed: {', '.join(sorted(backends))}")
    cls = backends[name]
    try:
        return cls(cls.config_model(**(settings or {})))
    except ValidationError as exc:
        raise InvalidRequest("; ".join(f"{prefix}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                                       for e in exc.errors())) from None
