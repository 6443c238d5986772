"""The environment of commands where the agent runs inside the sandbox's own image.

There (a pod, a one-job-per-sandbox Slurm job, a bundle started in any image) the image's
environment is the sandbox's: commands get the agent's own environment, minus Orchard's
variables (the agent token among them), and with what the bundle launcher had Python
change put back (``--restore-env``).
"""

from __future__ import annotations

import os
from typing import Iterable

INTERNAL_PREFIX = "ORCHARD_"


def restore(assignments: Iterable[str]) -> None:
    """``NAME=value`` sets a variable back, a bare ``NAME`` unsets it."""
    for assignment in assignments:
        name, has_value, value = assignment.partition("=")
        if has_value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)


def image_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith(INTERNAL_PREFIX)}
