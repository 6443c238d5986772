"""The hooks a plugin may implement. Each is small and documented; see docs/plugins.md.

A plugin is any module or object with ``@hookimpl`` functions, registered through the
``orchard`` entry-point group (``[project.entry-points.orchard] name = "pkg.module"``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pluggy

hookspec = pluggy.HookspecMarker("orchard")
hookimpl = pluggy.HookimplMarker("orchard")


@hookspec
def orchard_register_backends(register: Callable[[type], None]) -> None:
    """Register sandbox backends: call ``register(BackendClass)`` once per class.

    The class subclasses :class:`orchard.backends.api.Backend` and names itself with
    a static ``name`` ("local", "k8s", "slurm", ...), which is what configs refer to.
    """


@hookspec
def orchard_register_runtimes(register: Callable[[type], None]) -> None:
    """Register isolation runtimes for the exec agent: ``register(RuntimeClass)``.

    The class subclasses :class:`orchard.agent.runtimes.api.IsolationRuntime`. The
    agent loads plugins too, so a runtime must import without the orchestrator.
    """


@hookspec
def orchard_verify_image(image: str, policy: dict[str, Any]) -> Optional[str]:
    """Return a reason (a string) to refuse ``image``, or None to let it through.

    Every plugin is asked and any refusal wins: a permissive plugin can never
    override a stricter one (which ``firstresult`` would allow).
    """


@hookspec
def orchard_sandbox_event(event: dict[str, Any]) -> None:
    """Observe a sandbox life-cycle event (created, ready, failed, lost, deleted).

    ``event`` has at least ``type``, ``sandbox_id``, ``time``; handlers must be quick
    and must not raise (errors are logged and ignored).
    """


@hookspec
def orchard_add_commands(cli: Any) -> None:
    """Add click commands to the ``orchard`` CLI: ``cli`` is the top-level group, and
    its groups are ``cli.commands["bench"]``, ... (the Slurm backend adds ``bench slurm``)."""
