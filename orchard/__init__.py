"""Orchard: sandboxes for training language-model agents, and the trainers on top."""

from orchard.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl", "hookspec"]
