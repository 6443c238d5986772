"""The shared backend conformance suite, run here against the local backend."""

from orchard.testing.conformance import *  # noqa: F401,F403
