"""The server's OpenAPI schema, as checked into docs/openapi.json.

Refresh: ``python -m orchard.server.openapi > docs/openapi.json`` (a test fails when stale).
"""

from __future__ import annotations

import json
from types import SimpleNamespace


def openapi_json() -> str:
    from orchard.server.app import create_app
    from orchard.server.config import ServerConfig
    from orchard.server.observability import Metrics

    # Only the route declarations matter for the schema: no backend, store or loop is needed.
    service = SimpleNamespace(metrics=Metrics(), backend=SimpleNamespace(name="local"), config=ServerConfig())
    app = create_app(service, reconciler=None, api_key=None)  # type: ignore[arg-type]
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(openapi_json(), end="")
