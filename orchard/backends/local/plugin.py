"""Registers the local backend through the same hook a third-party plugin uses."""

from orchard.backends.local.backend import LocalBackend
from orchard.hookspecs import hookimpl


@hookimpl
def orchard_register_backends(register):
    register(LocalBackend)
