"""``orchard doctor --backend slurm``: the Slurm commands, a controller that answers,
accounting (the backend reads finished jobs' states from ``sacct``), and the isolation
runtime the settings name, asked through the runtime's own ``unavailable_reason``."""

from __future__ import annotations

from typing import Any

from orchard.backends.checks import Check, probe_check, tools_check
from orchard.plugins import collect

SLURM_FIX = "apt-get install slurm-client (a development cluster: bash slurm/dev-cluster.sh up)"
ACCOUNTING_FIX = ("run slurmdbd and set AccountingStorageType=accounting_storage/slurmdbd in slurm.conf "
                  "(a development cluster: bash slurm/dev-cluster.sh up)")


def runtime_checks(chosen: str) -> list[Check]:
    """The chosen runtime is required; the others are listed so the user sees the choices."""
    runtimes = collect("orchard_register_runtimes")
    checks = []
    for name, cls in sorted(runtimes.items()):
        reason = cls.unavailable_reason()
        required = name == chosen
        label = f"runtime {name}" + (" (chosen)" if required else "")
        checks.append(Check(label, reason is None, "available" if reason is None else "not available here", reason, required))
    if chosen not in runtimes:
        checks.append(Check(f"runtime {chosen} (chosen)", False, "not installed",
                            f"install the plugin that registers runtime {chosen!r}"))
    return checks


def slurm_checks(settings: dict[str, Any]) -> list[Check]:
    """Everything a Slurm backend with these settings needs from this machine."""
    return [
        tools_check("slurm commands", ("sbatch", "squeue", "scancel", "sinfo", "sacct"), SLURM_FIX),
        probe_check("slurm controller", ["sinfo", "-h", "-o", "%P %a %D"], "start slurmctld, or point SLURM_CONF at the cluster's "
                    "slurm.conf (a development cluster: bash slurm/dev-cluster.sh up)"),
        probe_check("slurm accounting", ["sacct", "-n", "-X", "-S", "now-1minutes", "-o", "JobID"], ACCOUNTING_FIX),
        *runtime_checks(str(settings.get("runtime", "bwrap"))),
    ]
