"""The nftables table of one agent's ``nat`` egress, as text for ``nft -f``.

One table per agent (``inet orchard_<id>``), matching its sandboxes' host-side interfaces
by name prefix, so rules never change per sandbox and one agent's table never touches
another's. Replaced atomically at start (the same transaction deletes and re-adds it).

- from a sandbox, to the host itself: refused (input), except DNS to a name server that is
  the host;
- from a sandbox, forwarded: its own pool address only as source; allowed networks and DNS
  to the configured name servers pass; blocked ranges are refused with a reset or an ICMP
  "administratively prohibited" (a fast error, not a hang); IPv6 is refused; the rest passes,
  masqueraded behind the host's address;
- into a sandbox: only replies (nothing on the host's networks can open a connection in).
"""

from __future__ import annotations

from typing import Iterable



def refuse(condition: str = "") -> str:
    """Refuse what matches ``condition`` at once: a TCP reset, else ICMP "prohibited"."""
    lead = f"{condition} " if condition else ""
    return f"{lead}meta l4proto tcp reject with tcp reset\n    {lead}reject with icmpx type admin-prohibited"


def table_name(agent_id: str) -> str:
    return f"orchard_{agent_id}"


def elements(values: Iterable[str]) -> str:
    listed = ", ".join(values)
    return f"elements = {{ {listed} }}" if listed else ""


def ruleset(agent_id: str, prefix: str, pool: str, blocked: Iterable[str], allowed: Iterable[str],
            nameservers: Iterable[str]) -> str:
    """The whole table; ``prefix`` is the interface-name prefix of this agent's sandboxes."""
    table = table_name(agent_id)
    match = f'"{prefix}*"'
    return f"""table inet {table}
delete table inet {table}
table inet {table} {{
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
    {refuse()}
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept
    iifname {match} jump from_sandbox
    oifname {match} ct state established,related accept
    oifname {match} drop
  }}
  chain from_sandbox {{
    {refuse("meta nfproto ipv6")}
    ip saddr != {pool} drop
    {refuse("oifname " + match)}
    ip daddr @allowed accept
    ip daddr @dns meta l4proto {{ tcp, udp }} th dport 53 accept
    {refuse("ip daddr @blocked")}
    accept
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept
    iifname {match} oifname != {match} masquerade
  }}
}}
"""


def add_blocked(agent_id: str, networks: Iterable[str]) -> str:
    """Add networks the host came to sit on after the table was written."""
    return f"add element inet {table_name(agent_id)} blocked {{ {', '.join(networks)} }}\n"


def delete_table(agent_id: str) -> str:
    table = table_name(agent_id)
    return f"table inet {table}\ndelete table inet {table}\n"
