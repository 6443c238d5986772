"""Registers the local backend through the same hook a third-party plugin uses."""

from orchard.hookspecs import hookimpl


@hookimpl
def orchard_register_backends(register):
    from orchard.backends.local.backend import LocalBackend  # only where backends are wanted (not in agents)

    register(LocalBackend)
