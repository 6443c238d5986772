"""The plugin manager: built-ins first, then the ``orchard`` entry points.

Built on demand, never at import time. ``ORCHARD_PLUGINS`` limits third-party
plugins: unset or "all" loads every entry point, "none" loads none, and a comma list
("slurm,k8s") loads only those entry-point names.
"""

from __future__ import annotations

import functools
import logging
import os
from importlib import metadata
from typing import Any, Optional

import pluggy

from orchard import hookspecs

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "orchard"
BUILTIN_PLUGINS = ("orchard.backends.local.plugin", "orchard.agent.runtimes.plugin", "orchard.agent.image_policy")


def _allowed_entry_points() -> Optional[set[str]]:
    setting = os.environ.get("ORCHARD_PLUGINS", "all").strip()
    if setting in ("", "all"):
        return None
    if setting == "none":
        return set()
    return {name.strip() for name in setting.split(",") if name.strip()}


@functools.lru_cache(maxsize=None)
def _cached_manager(allowed: Optional[frozenset[str]]) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("orchard")
    pm.add_hookspecs(hookspecs)
    for module_name in BUILTIN_PLUGINS:
        module = __import__(module_name, fromlist=["_"])
        pm.register(module, name=module_name)
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and entry_point.name not in allowed:
            continue
        if pm.has_plugin(entry_point.name) or entry_point.value in BUILTIN_PLUGINS:
            continue
        try:
            plugin = entry_point.load()
        except Exception as exc:  # a broken plugin must not take the others down
            log.warning("plugin %s failed to load: %s", entry_point.name, exc)
            continue
        pm.register(plugin, name=entry_point.name)
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, honouring ``ORCHARD_PLUGINS`` as it is now."""
    allowed = _allowed_entry_points()
    return _cached_manager(None if allowed is None else frozenset(allowed))


def reset_plugin_manager() -> None:
    """Forget the cached manager (tests that change ``ORCHARD_PLUGINS`` call this)."""
    _cached_manager.cache_clear()


def collect(hook_name: str) -> dict[str, type]:
    """Call a ``register`` hook and return what it registered, keyed by ``cls.name``."""
    found: dict[str, type] = {}

    def register(cls: type) -> None:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls!r} registered without a static 'name'")
        found.setdefault(name, cls)  # pluggy calls later plugins first; first wins

    getattr(get_plugin_manager().hook, hook_name)(register=register)
    return found


def distribution_of(obj: Any) -> tuple[str, str]:
    """(distribution name, version) that ships the module defining ``obj``."""
    top = obj.__module__.split(".")[0]
    for dist_name in metadata.packages_distributions().get(top, []):
        try:
            return dist_name, metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            continue
    return "(not installed)", "-"


def verify_image(image: str, policy: dict[str, Any]) -> Optional[str]:
    """Ask every plugin; the first refusal found is returned (any refusal wins)."""
    reasons = get_plugin_manager().hook.orchard_verify_image(image=image, policy=policy)
    return next((reason for reason in reasons if reason), None)


def emit_event(event: dict[str, Any]) -> None:
    """Tell every plugin about a sandbox event; a failing handler is logged, not raised."""
    try:
        get_plugin_manager().hook.orchard_sandbox_event(event=event)
    except Exception as exc:
        log.warning("orchard_sandbox_event handler failed: %s", exc)
