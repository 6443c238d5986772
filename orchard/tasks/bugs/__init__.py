"""The catalogue of planted bugs the task generator draws from: six families, three variants each."""

from orchard.tasks.bugs import boundaries, calls, edges
from orchard.tasks.bugs.base import Case, Outcome, Variant, describe, fill, run_cases

VARIANTS: list[Variant] = [*boundaries.VARIANTS, *edges.VARIANTS, *calls.VARIANTS]
FAMILIES: list[str] = list(dict.fromkeys(v.family for v in VARIANTS))

__all__ = ["Case", "FAMILIES", "Outcome", "VARIANTS", "Variant", "describe", "fill", "run_cases"]
