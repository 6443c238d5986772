"""The built-in local backend: sandboxes on this machine, served by one local agent."""

from orchard.backends.local.backend import LocalBackend, LocalBackendConfig

__all__ = ["LocalBackend", "LocalBackendConfig"]
