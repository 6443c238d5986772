"""Sandboxes with network get a network namespace of their own and a filtered way out.

The outside, private and metadata hosts are test hosts in namespaces made here (tests/netlab.py),
reached through a router, so only the egress's rules decide what a sandbox reaches.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from orchard.agent.settings import AgentSettings
from orchard.client import Client
from orchard.errors import RuntimeUnavailable, Unsupported
from orchard.testing.isolation import hello_service
from tests.netlab import NetLab, probe

OUTSIDE, PRIVATE, METADATA = "203.0.113.10", "192.168.77.10", "169.254.169.254"


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    lab = NetLab().up()
    yield lab
    lab.down()


@pytest.fixture
def listener_on_every_address() -> Iterator[int]:
    """A TCP service of the test host on 0.0.0.0 (all its addresses)."""
    yield from hello_service("0.0.0.0")


def host_addresses() -> list[str]:
    """Every IPv4 address of this host (loopback, its NIC, the lab's link, the egress gateway)."""
    listed = json.loads(subprocess.run(["ip", "-4", "-j", "addr"], capture_output=True, text=True, check=True).stdout)
    return sorted({entry["local"] for link in listed for entry in link.get("addr_info", [])})


def refused_fast(output: str) -> bool:
    """The probe's line for a refused connection, refused at once (a reset or ICMP, not a hang)."""
    words = output.split()
    return bool(words) and words[0] == "refused" and float(words[-1]) < 1.5


def sandbox_address(sandbox) -> str:
    return sandbox.exec(["python3", "-c", "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                         f"s.connect(({OUTSIDE!r}, 9)); print(s.getsockname()[0])"]).stdout.strip()


def test_an_open_sandbox_reaches_the_outside_behind_the_hosts_address(orchard_client, lab):
    with orchard_client.create(block_network=False) as open_:
        seen = open_.exec(probe(OUTSIDE)).stdout.strip()
        assert seen == f"hello-from-outside seen-from {lab.host_address}", seen  # masqueraded
        names = open_.exec(["python3", "-c", "import socket; print(*(n for _, n in socket.if_nameindex()))"]).stdout
        assert names.split() == ["lo", "eth0"], names  # a namespace of its own, not the host's interfaces
        assert "nameserver" in open_.exec("cat /etc/resolv.conf").stdout


def test_an_open_sandbox_reaches_neither_the_host_nor_its_private_neighbours(orchard_client, lab,
                                                                             listener_on_every_address):
    port = listener_on_every_address
    targets = [(address, port) for address in host_addresses()] + [(PRIVATE, 8080), (METADATA, 8080)]
    assert any(address.startswith("127.") for address, _ in targets) and (lab.host_address, port) in targets
    with orchard_client.create(block_network=False) as open_:
        for address, target_port in targets:
            output = open_.exec(probe(address, target_port)).stdout.strip()
            assert refused_fast(output), f"{address}:{target_port}: {output}"


def test_the_key_theft_path_is_closed_an_open_sandbox_cannot_take_a_host_port(orchard_client, lab):
    """The sandbox binds a port on its own loopback; the host's same port stays free for the
    host (on main the sandbox took the server's port while it restarted, and logged its key)."""
    with socket.socket() as probe_port:
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    with orchard_client.create(block_network=False) as open_:
        open_.exec(f"nohup python3 -c \"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); "
                   "s.listen(); time.sleep(60)\" >/dev/null 2>&1 & sleep 0.5")
        assert open_.exec(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\"").exit_code == 0
        with socket.socket() as ours:
            ours.bind(("127.0.0.1", port))  # free on the host: the sandbox's listener is in its own namespace


def test_open_sandboxes_cannot_reach_each_other(orchard_client, lab):
    with orchard_client.create(block_network=False) as first, orchard_client.create(block_network=False) as second:
        first.exec("nohup python3 -c \"import socket; s = socket.socket(); s.bind(('0.0.0.0', 9000)); s.listen(); "
                   "[s.accept()[0].sendall(b'hello-from-first') for _ in range(9)]\" >/dev/null 2>&1 & sleep 0.5")
        address = sandbox_address(first)
        assert address and address != sandbox_address(second)
        assert first.exec(probe(address, 9000)).stdout.startswith("hello-from-first")  # it listens
        output = second.exec(probe(address, 9000)).stdout.strip()
        assert refused_fast(output), output


def test_a_blocked_sandbox_still_has_no_way_out(orchard_client, lab):
    with orchard_client.create() as blocked:
        output = blocked.exec(probe(OUTSIDE)).stdout.strip()
        assert output.startswith("refused"), output
        assert blocked.exec(["python3", "-c", "import socket; print(len(socket.if_nameindex()))"]).stdout.strip() == "1"


def agent_links(prefix_of: str) -> set[str]:
    return {path.name for path in Path("/sys/class/net").iterdir() if path.name.startswith(prefix_of)}


def test_a_deleted_open_sandbox_leaves_no_interface_behind(orchard_client, lab):
    before = agent_links("o")
    with orchard_client.create(block_network=False) as open_:
        assert open_.exec(probe(OUTSIDE)).stdout.startswith("hello-from-outside")
        during = agent_links("o") - before
        assert len(during) == 1, during
    deadline = time.monotonic() + 10
    while agent_links("o") & during and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not agent_links("o") & during


# -- agents of their own, with other network settings ----------------------------------

@pytest.fixture
def own_agent(tmp_path_factory, kit_image) -> Iterator:
    """``make(**settings)`` -> (client, settings) of an agent of its own; every agent stopped at the end."""
    from orchard.backends.local.launcher import stop_agent

    made: list[AgentSettings] = []
    clients: list[Client] = []

    def make(**overrides) -> tuple[Client, AgentSettings]:
        state = Path(kit_image).parent / f"agent-egress-{len(made)}-{time.monotonic_ns()}"
        settings = AgentSettings(state_dir=state, image_dirs=["/tmp"], **overrides)
        made.append(settings)
        client = Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")})
        clients.append(client)
        return client, settings

    yield make
    for client in clients:
        client.close()
    for settings in made:
        stop_agent(settings)


def test_network_allow_opens_exactly_what_it_names(own_agent, lab):
    client, _ = own_agent(network_allow=[PRIVATE])
    with client.create(block_network=False) as open_:
        assert open_.exec(probe(PRIVATE)).stdout.startswith("hello-from-private")
        assert refused_fast(open_.exec(probe(METADATA)).stdout.strip())
        assert open_.exec(probe(OUTSIDE)).stdout.startswith("hello-from-outside")


def test_an_agent_removes_its_firewall_table_when_it_stops(own_agent, lab):
    from orchard.backends.local.launcher import stop_agent

    client, settings = own_agent(network_egress="nat")
    with client.create(block_network=False) as open_:
        assert open_.exec(probe(OUTSIDE)).stdout.startswith("hello-from-outside")
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    resources = client.resources()
    assert resources["network"]["egress"] == "nat", resources
    ours = [line for line in tables.splitlines() if "orchard_" in line]
    assert ours
    stop_agent(settings)
    after = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    assert len([line for line in after.splitlines() if "orchard_" in line]) == len(ours) - 1


def test_slirp_egress_reaches_the_outside_but_not_the_hosts_loopback(own_agent, lab, listener_on_every_address):
    client, _ = own_agent(network_egress="slirp")
    with client.create(block_network=False) as open_:
        assert open_.exec(probe(OUTSIDE)).stdout.startswith("hello-from-outside")
        assert "10.0.2.3" in open_.exec("cat /etc/resolv.conf").stdout
        for address in ("10.0.2.2", "127.0.0.1"):  # slirp's way to the host's loopback, and the sandbox's own
            output = open_.exec(probe(address, listener_on_every_address)).stdout.strip()
            assert output.startswith("refused"), f"{address}: {output}"


def test_an_agent_without_egress_refuses_open_sandboxes_by_name(own_agent):
    client, _ = own_agent(network_egress="none")
    with pytest.raises(Unsupported, match="block_network"):
        client.create(block_network=False)
    with client.create() as blocked:  # blocked ones are made as before
        assert blocked.exec("echo ok").stdout == "ok\n"


@pytest.mark.parametrize("setting, value", [("network_pool", "not-a-network"), ("network_allow", ["fd00::/8"]),
                                            ("network_dns", ["example.com"]), ("network_egress", "bridge")])
def test_bad_network_settings_name_the_setting(setting, value):
    with pytest.raises(ValueError, match=setting):
        AgentSettings(**{setting: value})


class EgressThatCannotStart:
    """Stands in for a host whose kernel has no nf_tables (a double: this machine has it)."""

    name = "nat"

    def __init__(self) -> None:
        self.started = False

    async def start(self) -> None:
        raise RuntimeUnavailable("network setup failed: nft: Error: Could not process rule: No such file or directory")


def test_an_egress_that_cannot_start_gives_way_under_auto_and_fails_when_named():
    import asyncio

    from orchard.agent.egress import start_egress
    from orchard.agent.reaper import ChildReaper

    auto = AgentSettings(state_dir="/tmp/egress-unit")
    chosen = asyncio.run(start_egress(EgressThatCannotStart(), auto, ChildReaper(), "abc"))  # type: ignore[arg-type]
    assert chosen.name == "none" and "nft" in chosen.describe()["reason"]
    named = AgentSettings(state_dir="/tmp/egress-unit", network_egress="nat")
    with pytest.raises(RuntimeUnavailable, match="network_egress 'nat' could not start"):
        asyncio.run(start_egress(EgressThatCannotStart(), named, ChildReaper(), "abc"))  # type: ignore[arg-type]


FLOOD = """
import socket
held, refused = [], 0
for n in range(40):
    try:
        held.append(socket.create_connection(("203.0.113.10", 8081), 3))  # kept open by the outside host
    except OSError:
        refused += 1
print(len(held), refused)
"""


def test_one_sandbox_cannot_take_the_shared_flow_table(own_agent, lab):
    """The conntrack table and the source ports behind the host's address are shared: one
    sandbox took 50,000 entries in half a second, and every port to one name server. Past
    network_max_flows its new flows are refused; a neighbour's go through."""
    client, _ = own_agent(network_max_flows=16)
    with client.create(block_network=False) as greedy, client.create(block_network=False) as neighbour:
        held, refused = map(int, greedy.exec(["python3", "-c", FLOOD]).stdout.split())
        assert held == 16 and refused == 40 - 16, (held, refused)
        assert neighbour.exec(probe(OUTSIDE)).stdout.startswith("hello-from-outside")


def test_a_new_agent_removes_the_tables_of_gone_agents(own_agent, lab):
    """Tables of killed agents stayed; one of an earlier agent of the same state directory
    would still apply its rules to the new agent's interfaces."""
    client, settings = own_agent()
    before = set(nft_tables())
    with client.create(block_network=False) as open_:
        assert open_.exec(probe(OUTSIDE)).stdout.startswith("hello-from-outside")
    ours = set(nft_tables()) - before
    assert len(ours) == 1, ours
    (table,) = ours
    agent_id = table.split("_")[1]
    ghosts = [f"orchard_{agent_id}_999999", "orchard_0123456789_999998", "orchard_0123456789"]  # same state dir;
    # a dead pid; a table of an agent from before the pid was in the name
    for ghost in ghosts:
        subprocess.run(["nft", "add", "table", "inet", ghost], check=True)
    from orchard.backends.local.launcher import stop_agent

    stop_agent(settings)
    again = Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")})
    try:
        with again.create(block_network=False) as open_:
            assert open_.exec(probe(OUTSIDE)).stdout.startswith("hello-from-outside")
            left = set(nft_tables())
            assert not set(ghosts) & left and table not in left, left
    finally:
        again.close()


def nft_tables() -> list[str]:
    listed = json.loads(subprocess.run(["nft", "-j", "list", "tables"], capture_output=True, text=True, check=True).stdout)
    return [entry["table"]["name"] for entry in listed["nftables"] if "table" in entry]
