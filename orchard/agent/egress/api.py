"""How a sandbox with network gets out: the ``Egress`` interface and the choice between them.

Every sandbox has a network namespace of its own, with network or without. A sandbox that
asked for network (``block_network: false``) is then given a way out by the agent's egress:

- ``nat`` (root agents): a veth pair into the namespace, routed and masqueraded by the host
  kernel, filtered by an nftables table of the agent's own (``nat.py``, ``ruleset.py``);
- ``slirp`` (agents that are not root): slirp4netns, user-mode networking with the host's
  loopback turned off (``slirp.py``); it cannot filter the host's other neighbours;
- ``none``: no way out; a create with ``block_network: false`` is refused by name;
- ``host``: the old way, the sandbox in the host's network namespace (it reaches every
  loopback service of the host): only when an operator names it.
"""

from __future__ import annotations

import logging
import os
import shutil
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Optional

from orchard.errors import RuntimeUnavailable, Unsupported

if TYPE_CHECKING:
    from orchard.agent.reaper import ChildReaper
    from orchard.agent.settings import AgentSettings

log = logging.getLogger("orchard.agent")


class Egress(ABC):
    """The way out of sandboxes with network, one for the agent."""

    name: ClassVar[str]
    shares_host_network: ClassVar[bool] = False  # an open sandbox lives in the host's namespace (``host``)

    def __init__(self, settings: "AgentSettings", reaper: "ChildReaper", agent_id: str) -> None:
        self.settings, self.reaper, self.agent_id = settings, reaper, agent_id

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """None if this egress can run here, else what a person can do about it."""
        return None

    async def start(self) -> None:
        """Host-wide setup, once, when the agent starts."""

    async def close(self) -> None:
        """Undo ``start`` when the agent stops (its sandboxes are gone by then)."""

    def resolv_conf(self) -> Optional[str]:
        """What an open sandbox reads as /etc/resolv.conf (None: the image's own)."""
        return None

    @abstractmethod
    async def attach(self, key: str, pid: int) -> None:
        """Give the network namespace of ``pid`` (sandbox ``key``'s holder, alive) its way
        out; a typed error if that cannot be done (the create then fails and is cleaned up)."""

    async def detach(self, key: str) -> None:
        """After sandbox ``key``'s holder is gone: release what ``attach`` took."""

    def describe(self) -> dict[str, object]:
        return {"egress": self.name}


class NoEgress(Egress):
    name = "none"
    reason = "agent setting network_egress is 'none'"  # why (``auto`` found no egress that runs here)

    async def attach(self, key: str, pid: int) -> None:
        raise Unsupported(f"block_network: false is not available on this agent ({self.reason})")

    def describe(self) -> dict[str, object]:
        return {"egress": self.name, "reason": self.reason}


class HostNetwork(Egress):
    """Open sandboxes share the host's network namespace: they reach the host's loopback
    services (the server, databases, Slurm's daemons). Only by the operator's choice."""

    name = "host"
    shares_host_network = True

    async def start(self) -> None:
        log.warning("network_egress 'host': sandboxes with network share this host's network namespace and reach "
                    "every service listening on its loopback")

    async def attach(self, key: str, pid: int) -> None:
        return None


def choose_egress(settings: "AgentSettings", reaper: "ChildReaper", agent_id: str) -> Egress:
    """The egress ``settings.network_egress`` names; ``auto``: nat for a root agent with
    nftables, else slirp where slirp4netns is installed, else none (with the reason)."""
    from orchard.agent.egress.nat import NatEgress
    from orchard.agent.egress.slirp import SlirpEgress

    kinds: dict[str, type[Egress]] = {k.name: k for k in (NatEgress, SlirpEgress, NoEgress, HostNetwork)}
    wanted = settings.network_egress
    if wanted != "auto":
        kind = kinds[wanted]
        reason = kind.unavailable_reason()
        if reason:
            raise RuntimeUnavailable(f"network_egress {wanted!r} cannot run here: {reason}")
        return kind(settings, reaper, agent_id)
    reasons = []
    for kind in (NatEgress, SlirpEgress):
        reason = kind.unavailable_reason()
        if reason is None:
            return kind(settings, reaper, agent_id)
        reasons.append(f"{kind.name}: {reason}")
    none = NoEgress(settings, reaper, agent_id)
    none.reason = "; ".join(reasons)
    return none


def tool(name: str) -> Optional[str]:
    """Where a system tool is, also for agents started with a PATH that lacks /usr/sbin."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def is_root() -> bool:
    return os.geteuid() == 0


async def start_egress(egress: Egress, settings: "AgentSettings", reaper: "ChildReaper", agent_id: str) -> Egress:
    """``egress`` started; under ``auto``, one that cannot start here (no nf_tables in the
    kernel, a read-only /proc/sys) gives way to ``none`` with its reason, rather than
    keeping the agent from serving blocked sandboxes."""
    try:
        await egress.start()
        return egress
    except (OSError, RuntimeUnavailable) as exc:
        if settings.network_egress != "auto":
            raise RuntimeUnavailable(f"network_egress {egress.name!r} could not start: {exc}") from None
        log.warning("network egress %r could not start (%s): sandboxes with network are refused", egress.name, exc)
        none = NoEgress(settings, reaper, agent_id)
        none.reason = f"{egress.name}: {exc}"
        return none
