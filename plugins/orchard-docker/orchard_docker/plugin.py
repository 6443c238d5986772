"""The plugin's one hook: register the ``docker`` backend (imported only when Orchard asks)."""

from __future__ import annotations

from typing import Callable

from orchard import hookimpl


@hookimpl
def orchard_register_backends(register: Callable[[type], None]) -> None:
    from orchard_docker.backend import DockerBackend

    register(DockerBackend)
