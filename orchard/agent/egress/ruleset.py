"""The nftables table of one agent's ``nat`` egress, as text for ``nft -f``.

One table per agent (``inet orchard_<id>_<pid>``), matching its sandboxes' host-side
interfaces by name prefix, so rules never change per sandbox and one agent's table never
touches another's. Written atomically at start; the tables of agents that are gone (their pid,
or an earlier agent of the same state directory) are removed then too (``stale_tables``).

- from a sandbox, to the host itself: refused (input), except DNS to a name server that is
  the host;
- from a sandbox, forwarded: its own pool address only as source; at most ``max_flows``
  connections tracked for it at once (the host's conntrack table and the masquerade's source
  ports are shared: one sandbox took 50,000 entries in half a second, and all the ports to
  one name server, which cut every other sandbox and the host off it); allowed networks and DNS
  to the configured name servers pass; blocked ranges are refused with a reset or an ICMP
  "administratively prohibited" (a fast error, not a hang); IPv6 is refused; the rest passes,
  masqueraded behind the host's address;
- into a sandbox: only replies (nothing on the host's networks can open a connection in).
"""

from __future__ import annotations

import os
import re
from typing import Iterable



REFUSE = "jump refused"  # at once: a TCP reset, else ICMP "prohibited" (never a silent drop that hangs a caller)


def table_name(agent_id: str, pid: int) -> str:
    return f"orchard_{agent_id}_{pid}"


TABLE_NAME = re.compile(r"orchard_([0-9a-f]{10})_([0-9]+)")
LEGACY_TABLE_NAME = re.compile(r"orchard_[0-9a-f]{10}")  # before the pid was in the name: never a live agent's


def stale_tables(names: Iterable[str], agent_id: str, pid: int) -> list[str]:
    """Of the tables ``names``, those to remove: an earlier agent's of this state directory
    (one agent per state directory: its interfaces now are ours, and its rules would still
    apply to them), and any whose process is gone."""
    stale = []
    for name in names:
        if LEGACY_TABLE_NAME.fullmatch(name):
            stale.append(name)
            continue
        match = TABLE_NAME.fullmatch(name)
        if match is None or int(match.group(2)) == pid:
            continue
        if match.group(1) == agent_id or not os.path.exists(f"/proc/{match.group(2)}"):
            stale.append(name)
    return stale


def elements(values: Iterable[str]) -> str:
    listed = ", ".join(values)
    return f"elements = {{ {listed} }}" if listed else ""


def ruleset(table: str, prefix: str, pool: str, blocked: Iterable[str], allowed: Iterable[str],
            nameservers: Iterable[str], max_flows: int) -> str:
    """The whole table; ``prefix`` is the interface-name prefix of this agent's sandboxes."""
    match = f'"{prefix}*"'
    return f"""table inet {table}
delete table inet {table}
table inet {table} {{
  set flows {{
    type ipv4_addr; flags dynamic; size 65535
  }}
  set blocked {{
    type ipv4_addr; flags interval; auto-merge
    {elements(blocked)}
  }}
  set allowed {{
    type ipv4_addr; flags interval; auto-merge
    {elements(allowed)}
  }}
  set dns {{
    type ipv4_addr
    {elements(nameservers)}
  }}
  chain input {{
    type filter hook input priority filter - 10; policy accept
    iifname {match} jump from_sandbox_to_host
  }}
  chain from_sandbox_to_host {{
    ip daddr @dns meta l4proto {{ tcp, udp }} th dport 53 accept
    {REFUSE}
  }}
  chain refused {{
    meta l4proto tcp reject with tcp reset
    reject with icmpx type admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept
    iifname {match} jump from_sandbox
    oifname {match} ct state established,related accept
    oifname {match} drop
  }}
  chain from_sandbox {{
    meta nfproto ipv6 {REFUSE}
    ip saddr != {pool} drop
    ct state new add @flows {{ ip saddr ct count over {max_flows} }} {REFUSE}
    oifname {match} {REFUSE}
    ip daddr @allowed accept
    ip daddr @dns meta l4proto {{ tcp, udp }} th dport 53 accept
    ip daddr @blocked {REFUSE}
    accept
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept
    iifname {match} oifname != {match} masquerade
  }}
}}
"""


def add_blocked(table: str, networks: Iterable[str]) -> str:
    """Add networks the host came to sit on after the table was written."""
    return f"add element inet {table} blocked {{ {', '.join(networks)} }}\n"


def delete_tables(tables: Iterable[str]) -> str:
    return "".join(f"table inet {table}\ndelete table inet {table}\n" for table in tables)
