"""What a sandbox promises, in the conformance suite: every backend runs these.

A backend that ignored ``block_network`` or a limit used to pass the kit; these fail it.
They need only the SDK and the ``host`` image (a shell, coreutils and python3).
"""

from __future__ import annotations

import socket
import threading
from typing import Iterator

import pytest

from orchard.errors import ImageRejected, InvalidRequest

FORK_BOMB = """python3 -c '
import os, time
for n in range(200):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    except OSError as exc:
        print("fork failed after", n, exc)
        break
'"""


def hello_service(address: str) -> Iterator[int]:
    """A TCP service of the test host on ``address`` that answers every connection; yields its port."""
    server = socket.socket()
    server.bind((address, 0))
    server.listen(16)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"hello-from-host\n")
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP service on the test host's loopback that answers every connection."""
    yield from hello_service("127.0.0.1")


def connect_probe(port: int) -> str:
    return ("python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', %d), 2); "
            "print(s.recv(100).decode(), end='')\"" % port)


def test_a_blocked_sandbox_reaches_no_network_not_even_host_loopback(orchard_client, host_listener, orchard_image):
    with orchard_client.create(orchard_image) as blocked:
        job = blocked.exec(connect_probe(host_listener))
        assert job.exit_code != 0 and "hello-from-host" not in job.stdout
        interfaces = blocked.exec(["python3", "-c", "import socket; print(*(n for _, n in socket.if_nameindex()))"])
        assert interfaces.stdout.split() == ["lo"], interfaces.stdout + interfaces.stderr


def refused_as_declared(orchard_client, image: str, unsupported: frozenset[str], **limit: object) -> bool:
    """True when the backend declared it cannot enforce this limit and refuses it, by name, as
    it must (a declared limit is never silently dropped); False when it must enforce it."""
    (name,) = limit
    if name not in unsupported:
        return False
    try:
        made = orchard_client.create(image, **limit)
    except InvalidRequest as exc:
        assert name in str(exc), f"refused, but the error does not name {name!r}: {exc}"
        return True
    made.delete()  # accepted, so dropped silently: that fails the kit, leaving nothing behind
    pytest.fail(f"{name} is declared unsupported, yet a sandbox asking for it was created (DID NOT RAISE)")


def test_memory_limit_is_enforced(orchard_client, orchard_image, orchard_unsupported):
    if refused_as_declared(orchard_client, orchard_image, orchard_unsupported, memory="64Mi"):
        return
    with orchard_client.create(orchard_image, memory="64Mi") as small:
        job = small.exec("python3 -c \"x = bytearray(300 * 2**20); print('allocated')\"", timeout=60)
        assert job.exit_code != 0 and "allocated" not in job.stdout
        assert small.exec("echo survived").stdout == "survived\n"


def test_pids_limit_is_enforced(orchard_client, orchard_image, orchard_unsupported):
    if refused_as_declared(orchard_client, orchard_image, orchard_unsupported, pids=40):
        return
    with orchard_client.create(orchard_image, pids=40) as bomb:
        job = bomb.exec(FORK_BOMB, timeout=30)
        assert "fork failed" in job.stdout, job.stdout + job.stderr


def test_disk_quota_gives_a_clear_error(orchard_client, orchard_image, orchard_unsupported):
    if refused_as_declared(orchard_client, orchard_image, orchard_unsupported, disk="8Mi"):
        return
    with orchard_client.create(orchard_image, disk="8Mi") as tiny:
        job = tiny.exec("head -c 20000000 /dev/zero > /tmp/big")
        assert job.exit_code != 0 and "No space left on device" in job.stderr
        written = int(tiny.exec("stat -c %s /tmp/big").stdout)
        assert written <= 8 << 20, f"{written} bytes written under an 8 MiB quota"  # stopped at the quota
        assert tiny.exec("rm -f /tmp/big && echo freed").stdout == "freed\n"


def test_cpu_limit_is_observable(orchard_client, orchard_image, orchard_unsupported):
    """A busy loop under cpu: 0.25 gets at most about a quarter of the wall time it runs."""
    burn = ("python3 -c \"import time, os; end = time.time() + 2\n"
            "while time.time() < end: pass\n"
            "t = os.times(); print(t.user + t.system)\"")
    if refused_as_declared(orchard_client, orchard_image, orchard_unsupported, cpu="0.25"):
        return
    with orchard_client.create(orchard_image, cpu="0.25") as limited:
        used = float(limited.exec(burn, timeout=60).stdout)
        assert used < 2 * 0.25 * 1.6, f"{used:.2f} CPU seconds in 2 s under a 0.25 CPU limit"


def test_image_policy_refusals_are_honoured(orchard_client):
    for image in ("/etc", "/", "docker://registry.invalid.example/steal:latest"):
        with pytest.raises(ImageRejected):
            orchard_client.create(image)

