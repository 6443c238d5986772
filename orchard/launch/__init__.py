"""Launch recipes: one YAML file per platform, the same two commands everywhere
(``orchard launch serve``, ``orchard launch train``); see :mod:`orchard.launch.recipe`."""

from orchard.launch.recipe import Recipe

__all__ = ["Recipe"]
