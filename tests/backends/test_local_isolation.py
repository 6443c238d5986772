"""Isolation of local sandboxes, checked from the host side as well as from inside."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchard.agent.host_ids import DEFAULT_HOST_UID
from orchard.bench.measure import count_processes
from orchard.testing.isolation import FORK_BOMB as KIT_FORK_BOMB
from orchard.testing.isolation import connect_probe, host_listener  # noqa: F401  (a fixture)
from tests.holders import holder_with_marker


def holder_pid(sandbox) -> int:
    """Find a sandbox's holder from the host, by a marker file only its root has."""
    marker = f"marker-{sandbox.id}"
    sandbox.exec(f"touch /tmp/{marker}")
    return holder_with_marker(marker)


def test_unprivileged_inside_and_outside(sandbox):
    inside = sandbox.exec("id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status").stdout.split("\n")
    assert inside[0] == "1000"
    assert "CapEff:\t0000000000000000" in inside and "CapBnd:\t0000000000000000" in inside
    assert "NoNewPrivs:\t1" in inside
    status = Path(f"/proc/{holder_pid(sandbox)}/status").read_text()
    host_uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    assert all(DEFAULT_HOST_UID < int(uid) < DEFAULT_HOST_UID + 64 * 65536 for uid in host_uids), \
        "sandbox processes must run as the agent's unprivileged sandbox ids, never root"


def test_host_image_exposes_only_the_allow_list(sandbox):
    for secret in ("/root", "/var/lib/orchard", "/run/munge", "/etc/shadow", "/home/user/../../root", "/tmp/orchard-test"):
        assert sandbox.exec(f"test -e {secret} && echo visible || echo hidden").stdout == "hidden\n", secret
    assert sandbox.exec("ls /proc | grep -c '^[0-9]'").stdout.strip() in {"1", "2", "3", "4", "5"}
    write = sandbox.exec("touch /usr/evil 2>&1; echo rc=$?")
    assert "Read-only file system" in write.stdout
    assert sandbox.exec("touch /workspace/ok /tmp/ok && echo ok").stdout == "ok\n"


def test_state_directories_are_private(agent_settings, sandbox):
    assert oct(os.stat(agent_settings.agent_dir).st_mode & 0o777) == "0o700"
    assert oct(os.stat(agent_settings.agent_dir / "token").st_mode & 0o777) == "0o600"
    assert oct(os.stat(agent_settings.sandboxes_dir).st_mode & 0o777) == "0o711"


def test_an_open_sandbox_does_not_reach_host_loopback(orchard_client, host_listener):
    """The other half of the kit's blocked-network test: asking for the network gives a way
    out (tests/agent/test_egress.py), never the host's loopback services."""
    with orchard_client.create(block_network=False) as open_:
        job = open_.exec(connect_probe(host_listener))
        assert job.exit_code != 0 and "hello-from-host" not in job.stdout, job.stdout + job.stderr


# The kit's fork bomb, marked so its processes can be counted from the host.
FORK_BOMB = KIT_FORK_BOMB.replace("import os, time", "import os, time  # orchard-fork-bomb")


def test_pids_limit_holds_and_spares_the_others(orchard_client):
    with orchard_client.create(pids=40) as bomb, orchard_client.create() as neighbour:
        job = bomb.exec(FORK_BOMB, timeout=20)
        assert "fork failed" in job.stdout, job.stdout + job.stderr
        assert neighbour.exec("echo fine").stdout == "fine\n"
        assert 0 < count_processes("orchard-fork-bomb") <= 40
    assert count_processes("orchard-fork-bomb") == 0  # deleting the sandbox killed everything in it


def test_memory_limit_names_the_oom_in_the_job(orchard_client):
    with orchard_client.create(memory="64Mi") as small:
        job = small.exec("python3 -c \"x = bytearray(300 * 2**20); print('allocated')\"", timeout=60)
        assert job.exit_code == 137 and "memory limit" in (job.error or "")


def test_zombies_are_reaped(sandbox):
    sandbox.exec("for i in 1 2 3; do (sleep 0.1 &) ; done; sleep 0.5")
    zombies = sandbox.exec("grep -l '^State:.*Z' /proc/[0-9]*/status 2>/dev/null | wc -l").stdout.strip()
    assert zombies == "0"


def host_uid_of(sandbox) -> int:
    status = Path(f"/proc/{holder_pid(sandbox)}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def test_each_sandbox_has_its_own_host_uid_so_per_user_limits_are_its_own(orchard_client):
    """All sandboxes shared host uid 100000: one exhausting the per-user inotify limit (128
    instances) broke inotify in every other sandbox on the host."""
    hog = ("import ctypes, time; libc = ctypes.CDLL(None); fds = [libc.inotify_init() for _ in range(400)]; "
           "open('/tmp/held', 'w').write(str(sum(fd >= 0 for fd in fds))); time.sleep(120)")
    probe = "import ctypes; print(ctypes.CDLL(None).inotify_init())"
    with orchard_client.create("host") as greedy, orchard_client.create("host") as neighbour:
        assert host_uid_of(greedy) != host_uid_of(neighbour)
        greedy.exec(f"python3 -c \"{hog}\" > /dev/null 2>&1 &")
        greedy.exec("for i in $(seq 100); do [ -s /tmp/held ] && break; sleep 0.1; done")
        assert int(greedy.download("/tmp/held")) < 400  # it did hit its own limit
        assert int(greedy.exec(["python3", "-c", probe]).stdout) < 0
        assert int(neighbour.exec(["python3", "-c", probe]).stdout) >= 0



def host_has_vsock() -> bool:
    import socket

    try:
        socket.socket(40, socket.SOCK_STREAM).close()  # AF_VSOCK
    except OSError:
        return False
    return True


def test_vsock_sockets_are_refused_although_the_host_has_them(orchard_client):
    """A network namespace does not confine AF_VSOCK (it reaches the hypervisor's and host's
    vsock services), so the seccomp filter refuses it, as the container default profiles do."""
    import errno

    script = ("import socket\ntry:\n    socket.socket(40, socket.SOCK_STREAM)\n    print('opened')\n"
              "except OSError as exc:\n    print(exc.errno)\n")
    allowed = {str(errno.EPERM)} if host_has_vsock() else {str(errno.EPERM), str(errno.EAFNOSUPPORT)}
    for block_network in (True, False):
        with orchard_client.create(block_network=block_network) as sandbox:
            result = sandbox.exec(["python3", "-c", script])
            assert result.stdout.strip() in allowed, result.stdout + result.stderr


def test_one_sandbox_cannot_take_the_hosts_terminals(orchard_client, agent_settings):
    """Each sandbox's devpts is capped (sandbox_ptys): one that opened 3,071 terminals left
    the next ENOSPC on /dev/ptmx, since the kernel's pool is the host's."""
    script = ("import os\nheld = []\ntry:\n    while len(held) < 5000:\n        held.append(os.openpty())\n"
              "except OSError as exc:\n    print(len(held), exc.errno)\n")
    with orchard_client.create() as greedy, orchard_client.create() as neighbour:
        opened, code = greedy.exec(["python3", "-c", script]).stdout.split()
        assert int(opened) == agent_settings.sandbox_ptys and code == "28", (opened, code)  # ENOSPC at its own cap
        assert neighbour.exec(["python3", "-c", "import pty; pty.openpty(); print('mine')"]).stdout == "mine\n"


def test_dev_shm_has_a_size_of_its_own_within_the_disk_quota(orchard_client):
    """/dev/shm was a directory of the /dev tmpfs, which had no size: 64 MiB went in under disk: 32Mi."""
    with orchard_client.create(disk="16Mi") as small:
        job = small.exec("head -c 40000000 /dev/zero > /dev/shm/big")
        assert job.exit_code != 0 and "No space left" in job.stderr, job
        assert int(small.exec("stat -c %s /dev/shm/big").stdout) <= 16 << 20
        assert small.exec("stat -c %a /dev/shm").stdout == "1777\n"


def test_agent_status_asks_nothing_a_sandbox_process_names(orchard_client):
    """`orchard agent status` found agents by command line and asked the address their
    agent.json gave, before checking the pid: a sandbox process claiming an agent's command
    line, with a state directory in its own root, had root's status send it a request."""
    import json as json_module
    import socket as socket_module
    import threading as threading_module
    import time as time_module

    from orchard.backends.local.launcher import running_agents

    hits: list[bytes] = []
    listener = socket_module.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            hits.append(conn.recv(1024))
            conn.close()

    threading_module.Thread(target=accept, daemon=True).start()
    try:
        with orchard_client.create() as sandbox:
            state = f"/proc/{holder_pid(sandbox)}/root/tmp/evil"
            record = json_module.dumps({"pid": 1, "address": f"http://127.0.0.1:{listener.getsockname()[1]}"})
            sandbox.upload("/tmp/evil/agent/agent.json", record)
            sandbox.exec("chmod 700 /tmp/evil/agent", check=True)
            sandbox.exec(f"nohup python3 -c 'import time; time.sleep(60)' -m orchard.agent --state-dir {state} "
                         ">/dev/null 2>&1 & sleep 0.5", check=True)
            found = running_agents()
            time_module.sleep(0.2)
            assert not hits, hits
            assert all(agent["state_dir"] != state for agent in found)
    finally:
        listener.close()


def test_all_sandboxes_together_stay_inside_total_pids(tmp_path_factory):
    """Eight sandboxes at the default 4,096 processes took the whole pid space of a host
    whose pid_max is 32,768: the agent's own group bounds them all (total_pids)."""
    import time as time_module

    from orchard.agent.cgroups import V1_ROOT
    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import stop_agent
    from orchard.client import Client

    state = Path(f"/tmp/orchard-total-pids-{os.getpid()}-{time_module.monotonic_ns()}")
    settings = AgentSettings(state_dir=state, image_dirs=["/tmp"], total_pids=120)
    client = Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")})
    try:
        with client.create() as first:
            job = first.exec(FORK_BOMB.replace("range(200)", "range(300)"), timeout=30)
            assert "fork failed" in job.stdout, job.stdout + job.stderr
            forked = int(job.stdout.split("fork failed after")[1].split()[0])
            assert forked < 120, forked  # not its own 4,096
            limits = [p.read_text().strip() for p in V1_ROOT.glob("pids/orchard/*/pids.max")
                      if p.parent.name.startswith(state.name)] or \
                     [p.read_text().strip() for p in V1_ROOT.glob("orchard/*/pids.max") if p.parent.name.startswith(state.name)]
            assert limits == ["120"], limits
    finally:
        client.close()
        stop_agent(settings)


def test_sandboxes_get_their_own_open_files_limit_not_the_agents(orchard_client, agent_settings):
    """The agent raises its own limit to the host's hard one, and every sandbox process
    inherited it: 50 processes of one sandbox held 1,001,833 open files."""
    import resource

    hard = agent_settings.sandbox_open_files
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[1] > hard  # the test host's is higher: not vacuous
    script = "import resource; print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
    with orchard_client.create() as sandbox:
        assert sandbox.exec(["python3", "-c", script]).stdout.split() == [str(min(1024, hard)), str(hard)]
        assert sandbox.exec(["python3", "-c", script], env={"X": "1"}).stdout.split() == [str(min(1024, hard)), str(hard)]
        raised = sandbox.exec(["python3", "-c", "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, "
                               f"({hard + 1}, {hard + 1})); print('raised')"])
        assert "raised" not in raised.stdout  # the hard limit holds


def test_dev_itself_takes_no_files(orchard_client):
    """bwrap's /dev is a tmpfs of no size owned by the sandbox user: 200 MiB in 20,000 files
    went into it under disk: 16Mi. It is read-only; its devices still work."""
    with orchard_client.create(disk="16Mi") as small:
        job = small.exec("head -c 1000000 /dev/zero > /dev/filler")
        assert job.exit_code != 0 and "Read-only file system" in job.stderr, job
        assert small.exec("echo x > /dev/null && head -c 3 /dev/urandom | wc -c").stdout.strip() == "3"


SOCKET_HOARD = """
import socket
pairs, total = [], 0
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(64)
for _ in range(40):
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    a.setblocking(False)
    while True:
        try:
            total += a.send(b"x" * 65536)
        except OSError:
            break
    pairs.append((a, b))
print(total)
"""


def test_socket_buffers_count_against_the_sandbox(orchard_client, agent_settings):
    """On cgroup v1 the TCP buffers of a sandbox's sockets are outside its memory limit: a
    blocked sandbox held 1.87 GiB of the host's tcp_mem with 300 loopback pairs."""
    from orchard.agent.cgroups import V1_ROOT
    from orchard.quantities import parse_bytes

    if not (V1_ROOT / "memory" / "memory.kmem.tcp.limit_in_bytes").exists():
        assert not (V1_ROOT / "memory").is_dir()  # cgroup v2: socket memory is in memory.max already
        return
    cap = parse_bytes(agent_settings.sandbox_socket_memory)
    with orchard_client.create() as hoarder:
        buffered = int(hoarder.exec(["python3", "-c", SOCKET_HOARD], timeout=60).stdout)
        assert buffered <= cap * 1.25, f"{buffered} bytes buffered past a {cap}-byte socket memory cap"


def test_a_root_agent_lifts_the_hosts_file_limit_so_memory_bounds_files():
    """One sandbox at its limits reached a fifth of fs.file-max (500,000 files in 183 MB of
    its memory); at file-max every process of the host gets ENFILE. Files are charged to the
    sandbox's memory cgroup, so the agent lifts the global limit, as systemd does."""
    import time as time_module

    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import stop_agent
    from orchard.client import Client

    file_max = Path("/proc/sys/fs/file-max")
    file_max.write_text("2466310\n")  # a kernel's own default on a host of this size (an earlier agent lifted it)
    settings = AgentSettings(state_dir=Path(f"/tmp/orchard-file-max-{os.getpid()}-{time_module.monotonic_ns()}"))
    client = Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")})
    try:
        with client.create(memory="256Mi") as sandbox:
            assert sandbox.exec("echo ok").stdout == "ok\n"
            assert int(file_max.read_text()) == (1 << 63) - 1
    finally:
        client.close()
        stop_agent(settings)
