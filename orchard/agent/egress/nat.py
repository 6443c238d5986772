"""``nat``: a veth pair per open sandbox, routed and masqueraded by the host kernel.

The sandbox's end is ``eth0`` in its own network namespace, with one address from the pool
(``network_pool``) and a default route through 169.254.1.1, an address every host end has.
The host's end is named ``<prefix><random>``, so the agent's nftables table (``ruleset.py``)
matches every sandbox of this agent with one wildcard and no rule changes per sandbox. The
address comes from the host end's interface index, unique on the host while the interface
lives, so agents on one host (Slurm pilots of several jobs) share the pool without a lease
file. When the holder dies its namespace goes, and the kernel removes both ends with it.
Costs three short tool runs per create (``ip`` twice, ``nft`` only when the host's own
networks changed).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Optional

from orchard.agent.egress.api import Egress, is_root, tool
from orchard.agent.egress.ranges import (
    blocked_networks, host_nameservers, on_link_networks, parse_networks, resolv_conf_text,
)
from orchard.agent.egress.ruleset import add_blocked, delete_tables, ruleset, stale_tables, table_name
from orchard.agent.reaper import run_tool
from orchard.errors import RuntimeUnavailable

log = logging.getLogger("orchard.agent")
GATEWAY = "169.254.1.1"  # on every host end; the sandbox's next hop
TOOL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
ATTEMPTS = 4  # an interface index whose pool address a live sandbox still holds: try a new pair


class NatEgress(Egress):
    name = "nat"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = self.settings
        self.prefix = "o" + self.agent_id[:4]  # 5 characters + 10 random: IFNAMSIZ allows 15
        self.table = table_name(self.agent_id, os.getpid())
        self.pool = ipaddress.IPv4Network(settings.network_pool)
        self.allowed = [str(n) for n in parse_networks(settings.network_allow, "network_allow")]
        dns = settings.network_dns if settings.network_dns is not None else host_nameservers()
        self.nameservers = [str(a.network_address) for a in parse_networks(dns, "network_dns")]
        self._neighbours: set[ipaddress.IPv4Network] = set()
        self._links: dict[str, str] = {}  # sandbox id -> host end, while its holder lives

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if not is_root():
            return "needs a root agent (veth pairs and nftables)"
        missing = [name for name in ("ip", "nft", "nsenter") if tool(name) is None]
        if missing:
            return f"{', '.join(missing)} not installed (apt-get install iproute2 nftables util-linux)"
        return None

    def resolv_conf(self) -> Optional[str]:
        return resolv_conf_text(self.nameservers)

    def describe(self) -> dict[str, object]:
        return {"egress": self.name, "pool": str(self.pool), "allowed": self.allowed, "nameservers": self.nameservers,
                "max_flows": self.settings.network_max_flows, "table": self.table}

    # -- host-wide -------------------------------------------------------------------
    async def start(self) -> None:
        if IP_FORWARD.read_text().strip() != "1":
            log.warning("network_egress 'nat': turning on IPv4 forwarding (net.ipv4.ip_forward=1), as container "
                        "engines do; this agent's nftables table forwards only its sandboxes' traffic")
            IP_FORWARD.write_text("1\n")
        self._neighbours = self._uncovered(on_link_networks())
        blocked = blocked_networks(self.pool, self._neighbours)
        listed = json.loads(await self._run([tool("nft") or "nft", "-j", "list", "tables"]))
        names = [entry["table"]["name"] for entry in listed.get("nftables", []) if "table" in entry]
        await self._nft(delete_tables(stale_tables(names, self.agent_id, os.getpid())) +
                        ruleset(self.table, self.prefix, str(self.pool), blocked, self.allowed, self.nameservers,
                                self.settings.network_max_flows))

    async def close(self) -> None:
        try:
            await self._nft(delete_tables([self.table]))
        except RuntimeUnavailable as exc:
            log.warning("could not remove this agent's nftables table: %s", exc)

    async def _nft(self, text: str) -> None:
        await self._run([tool("nft") or "nft", "-f", "/dev/fd/3"], text)

    async def _run(self, argv: list[str], stdin_text: Optional[str] = None, fds: Optional[dict[int, int]] = None) -> str:
        passed = dict(fds or {})
        memfd = None
        if stdin_text is not None:
            memfd = os.memfd_create("egress-batch")
            os.write(memfd, stdin_text.encode())
            os.lseek(memfd, 0, os.SEEK_SET)
            passed[memfd] = 3
        try:
            code, out, err = await run_tool(self.reaper, argv, TOOL_ENV, pass_fds=passed)
        finally:
            if memfd is not None:
                os.close(memfd)
        if code != 0:
            raise RuntimeUnavailable(f"network setup failed: {os.path.basename(argv[0])}: {err.strip() or out.strip()}")
        return out

    def _uncovered(self, networks: list[ipaddress.IPv4Network]) -> set[ipaddress.IPv4Network]:
        """Those not inside a range blocked anyway (the routes to this pool's sandboxes among them)."""
        static = [ipaddress.IPv4Network(n) for n in blocked_networks(self.pool)]
        return {n for n in networks if not any(n.subnet_of(b) for b in static)}

    async def _track_neighbours(self) -> None:
        """A network the host came to sit on after the agent started is blocked too."""
        new = self._uncovered(on_link_networks()) - self._neighbours
        if new:
            await self._nft(add_blocked(self.table, sorted(str(n) for n in new)))
            self._neighbours |= new

    # -- per sandbox -------------------------------------------------------------------
    async def attach(self, key: str, pid: int) -> None:
        await self._track_neighbours()
        try:
            netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise RuntimeUnavailable(f"sandbox {key!r}: its holder is gone before its network was set up ({exc})") from None
        try:
            for _ in range(ATTEMPTS):
                link = self.prefix + secrets.token_hex(5)
                await self._run([tool("ip") or "ip", "link", "add", link, "type", "veth", "peer", "name", "eth0",
                                 "netns", "/dev/fd/4"], fds={netns: 4})
                address = self._address(int(Path(f"/sys/class/net/{link}/ifindex").read_text()))
                if address is None or not await self._host_end(link, address):
                    await self._delete(link)
                    continue
                await self._run([tool("nsenter") or "nsenter", "--net=/dev/fd/4", tool("ip") or "ip", "-b", "/dev/fd/3"],
                                sandbox_end(address), fds={netns: 4})
                self._links[key] = link
                return
        finally:
            os.close(netns)
        raise RuntimeUnavailable(f"no free address in network_pool {self.pool} after {ATTEMPTS} tries")

    def _address(self, ifindex: int) -> Optional[str]:
        offset = ifindex % self.pool.num_addresses
        if offset == 0 or offset == self.pool.num_addresses - 1:
            return None
        return str(self.pool.network_address + offset)

    async def _host_end(self, link: str, address: str) -> bool:
        """Bring the host end up with the gateway address and a route to the sandbox;
        False when another live sandbox holds that address (its route exists)."""
        batch = f"link set {link} up\naddr add {GATEWAY}/32 dev {link} scope link\nroute add {address}/32 dev {link}\n"
        try:
            Path(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6").write_text("1\n")
            await self._run([tool("ip") or "ip", "-b", "/dev/fd/3"], batch)
        except RuntimeUnavailable as exc:
            if "File exists" in str(exc):
                return False
            raise
        return True

    async def _delete(self, link: str) -> None:
        code, _, _ = await run_tool(self.reaper, [tool("ip") or "ip", "link", "del", link], TOOL_ENV)
        if code != 0:
            log.debug("interface %s was already gone", link)

    async def detach(self, key: str) -> None:
        link = self._links.pop(key, None)
        if link is not None and Path(f"/sys/class/net/{link}").exists():
            await self._delete(link)  # the kernel does it with the namespace; sooner frees the address


def sandbox_end(address: str) -> str:
    """``ip -b`` lines run inside the sandbox's namespace."""
    return (f"addr add {address}/32 dev eth0\nlink set eth0 up\nroute add {GATEWAY} dev eth0 scope link\n"
            f"route add default via {GATEWAY} dev eth0\n")
