"""A small network of test hosts in network namespaces made here, for the egress tests.

    host --(10.213.0.1/30 : 10.213.0.2/30)-- router --+-- outside   203.0.113.10  (TEST-NET-3)
                                                      +-- private   192.168.77.10
                                                      '-- metadata  169.254.169.254

The router forwards; the host routes the three addresses through it (with a blackhole route
behind each, so their traffic never leaves the machine even if a route goes), none of them on
the host's own links (on-link networks are refused as the host's neighbours; these must be
refused, or reached, by the sandbox egress's rules and nothing else). Each test host runs a
TCP service on port 8080 that answers with its own name and the address it saw the
connection come from, and on 8081 the same, keeping the connection open for 10 s. Everything lives in namespaces named after this process and goes at
teardown; no packet leaves the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

SERVICE_PORT = 8080
HOLD_PORT = 8081  # the same answer, the connection then kept open for 10 s
BLACKHOLE_METRIC = "4242"
HOSTS = {"outside": ("203.0.113.10", "203.0.113.1/24"), "private": ("192.168.77.10", "192.168.77.1/24"),
         "metadata": ("169.254.169.254", "169.254.0.1/16")}
ANSWER = """
import socket, sys, time
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(256)
held = []
while True:
    conn, peer = server.accept()
    conn.sendall(f"hello-from-{sys.argv[3]} seen-from {peer[0]}\\n".encode())
    if sys.argv[4] == "hold":  # keeps the connection open for a while (a flow that stays)
        held = [(c, t) for c, t in held if time.monotonic() - t < 10 or c.close()] + [(conn, time.monotonic())]
    else:
        conn.close()
"""


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@dataclass
class NetLab:
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    services: list[subprocess.Popen] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    @property
    def router(self) -> str:
        return f"olab-router-{self.tag}"

    @property
    def host_end(self) -> str:
        return f"labh{self.tag}"[:15]

    host_address = "10.213.0.1"
    router_address = "10.213.0.2"

    def up(self) -> "NetLab":
        remove_dead_labs()
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        sh("ip", "netns", "add", self.router)
        self.namespaces.append(self.router)
        sh("ip", "-n", self.router, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh("ip", "link", "add", self.host_end, "type", "veth", "peer", "name", "up0", "netns", self.router)
        sh("ip", "addr", "add", f"{self.host_address}/30", "dev", self.host_end)
        sh("ip", "link", "set", self.host_end, "up")
        sh("ip", "-n", self.router, "addr", "add", f"{self.router_address}/30", "dev", "up0")
        sh("ip", "-n", self.router, "link", "set", "up0", "up")
        sh("ip", "-n", self.router, "route", "add", "default", "via", self.host_address)
        for index, (name, (address, router_side)) in enumerate(HOSTS.items()):
            namespace = f"olab-{name}-{self.tag}"
            sh("ip", "netns", "add", namespace)
            self.namespaces.append(namespace)
            sh("ip", "-n", namespace, "link", "set", "lo", "up")
            sh("ip", "link", "add", f"d{index}", "netns", self.router, "type", "veth", "peer", "name", "eth0",
               "netns", namespace)
            sh("ip", "-n", self.router, "addr", "add", router_side, "dev", f"d{index}")
            sh("ip", "-n", self.router, "link", "set", f"d{index}", "up")
            prefix = router_side.split("/")[1]
            sh("ip", "-n", namespace, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
            sh("ip", "-n", namespace, "link", "set", "eth0", "up")
            sh("ip", "-n", namespace, "route", "add", "default", "via", router_side.split("/")[0])
            # a blackhole behind the lab's route: should the route go (another lab's teardown, a
            # crash), traffic for the test hosts is dropped here, never sent out the default route
            sh("ip", "route", "replace", "blackhole", f"{address}/32", "metric", BLACKHOLE_METRIC)
            sh("ip", "route", "replace", f"{address}/32", "via", self.router_address)
            for port, mode in ((SERVICE_PORT, "answer"), (HOLD_PORT, "hold")):
                self.services.append(subprocess.Popen(
                    ["ip", "netns", "exec", namespace, sys.executable, "-c", ANSWER, address, str(port), name, mode],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for name, (address, _) in HOSTS.items():
            self._wait_for(address, name)

    def _wait_for(self, address: str, name: str) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            probe = subprocess.run([sys.executable, "-c", probe_script(address)], capture_output=True, text=True,
                                   timeout=10)
            if f"hello-from-{name}" in probe.stdout:
                return
            time.sleep(0.1)
        raise RuntimeError(f"test host {name} at {address} did not answer")

    def down(self) -> None:
        for process in self.services:
            process.kill()
            process.wait(10)
        for address, _ in HOSTS.values():  # this lab's route only; the blackhole stays while any lab lives
            subprocess.run(["ip", "route", "del", f"{address}/32", "via", self.router_address, "metric", "0"],
                           capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_end], capture_output=True)
        for namespace in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.namespaces.clear()
        self.services.clear()
        if not any(line.startswith("olab-") for line in namespaces()):
            for address, _ in HOSTS.values():
                subprocess.run(["ip", "route", "del", "blackhole", f"{address}/32", "metric", BLACKHOLE_METRIC],
                               capture_output=True)


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()


def remove_dead_labs() -> None:
    """Labs a killed test run left (named after a process that is gone): their namespaces,
    host ends and routes would clash with a new one's."""
    for line in namespaces():
        name = line.split(" ")[0]
        tag = name.rsplit("-", 1)[-1]
        if name.startswith("olab-") and tag.isdigit() and not os.path.exists(f"/proc/{tag}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            subprocess.run(["ip", "link", "del", f"labh{tag}"[:15]], capture_output=True)


def probe_script(address: str, port: int = SERVICE_PORT, timeout: float = 3.0) -> str:
    """Python that connects to ``address:port`` and prints what it got, or the error's name."""
    return (f"import socket, time\nstart = time.monotonic()\n"
            f"try:\n    s = socket.create_connection(({address!r}, {port}), {timeout})\n"
            f"    print(s.recv(200).decode().strip())\n"
            f"except OSError as exc:\n    print('refused', type(exc).__name__, round(time.monotonic() - start, 2))\n")


def probe(address: str, port: int = SERVICE_PORT, timeout: float = 3.0) -> list[str]:
    """The probe as a command for ``sandbox.exec``."""
    return ["python3", "-c", probe_script(address, port, timeout)]
