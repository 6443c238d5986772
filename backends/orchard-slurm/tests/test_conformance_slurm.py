"""The shared backend conformance suite, run against the Slurm backend on the dev cluster
(pilots running the bubblewrap runtime)."""

from orchard.testing.conformance import *  # noqa: F401,F403

orchard_backends = ["slurm"]
