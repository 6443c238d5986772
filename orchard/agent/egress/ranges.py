"""Which IPv4 destinations a sandbox with network may not reach, and which name servers it uses.

A sandbox with ``block_network: false`` gets a network namespace of its own whose only way
out is the agent's egress (``nat.py``, ``slirp.py``). What it must never reach: the host
itself (its loopback and its own addresses), the networks the host sits on (its LAN, the
node network of a cluster, a Slurm controller), private and link-local ranges (cloud metadata
at 169.254.169.254) and other sandboxes. Operators open exceptions with ``network_allow``.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from pathlib import Path
from typing import Iterable

# IANA special-purpose ranges (RFC 6890 and successors) that are never "the internet":
# this network, private, shared (CGNAT), loopback, link-local, IETF protocol assignments,
# benchmarking, multicast and reserved. The documentation ranges (TEST-NET-1..3) are left
# out: nothing real lives there, and the tests' outside host does.
BLOCKED_RANGES = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
)
RTF_GATEWAY = 0x2
RTF_REJECT = 0x200  # blackhole, unreachable and prohibit routes: nothing is reached through them


def parse_networks(values: Iterable[str], setting: str) -> list[ipaddress.IPv4Network]:
    """IPv4 networks ('10.1.2.3' or '10.1.0.0/16'); a ValueError naming ``setting`` otherwise."""
    networks = []
    for value in values:
        try:
            network = ipaddress.ip_network(value, strict=False)
        except ValueError as exc:
            raise ValueError(f"{setting}: {value!r} is not an IPv4 address or network ({exc})") from None
        if not isinstance(network, ipaddress.IPv4Network):
            raise ValueError(f"{setting}: {value!r} is IPv6; sandboxes have IPv4 egress only")
        networks.append(network)
    return networks


def on_link_networks(route_table: Path = Path("/proc/net/route")) -> list[ipaddress.IPv4Network]:
    """The networks the host reaches without a gateway (its LANs, device routes), from the
    kernel's main routing table: a sandbox must not reach its host's neighbours either."""
    networks = []
    try:
        lines = route_table.read_text().splitlines()[1:]
    except OSError:
        return networks
    for line in lines:
        fields = line.split()
        if len(fields) < 8:
            continue
        destination, flags, mask = int(fields[1], 16), int(fields[3], 16), int(fields[7], 16)
        if flags & (RTF_GATEWAY | RTF_REJECT) or mask == 0 or fields[0] == "*":
            continue  # via a router, the default route (the way out), or a route to nowhere: no neighbour
        address = socket.inet_ntoa(struct.pack("<I", destination))
        netmask = socket.inet_ntoa(struct.pack("<I", mask))
        networks.append(ipaddress.IPv4Network(f"{address}/{netmask}", strict=False))
    return networks


def blocked_networks(pool: ipaddress.IPv4Network, extra: Iterable[ipaddress.IPv4Network] = ()) -> list[str]:
    """Every range a sandbox is refused, collapsed: the special-purpose ranges, the pool
    sandboxes take their addresses from (no sandbox reaches another) and ``extra``."""
    networks = [ipaddress.IPv4Network(r) for r in BLOCKED_RANGES] + [pool, *extra]
    return [str(n) for n in ipaddress.collapse_addresses(networks)]


def host_nameservers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The host's IPv4 name servers, loopback ones left out (a sandbox cannot reach the
    host's loopback; a host that resolves through 127.0.0.53 needs ``network_dns``)."""
    servers = []
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return servers
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            try:
                address = ipaddress.ip_address(fields[1])
            except ValueError:
                continue
            if isinstance(address, ipaddress.IPv4Address) and not address.is_loopback:
                servers.append(str(address))
    return servers


def resolv_conf_text(nameservers: Iterable[str]) -> str:
    lines = [f"nameserver {server}" for server in nameservers]
    return "\n".join(["# written by the orchard agent: the name servers sandboxes with network use", *lines]) + "\n"
