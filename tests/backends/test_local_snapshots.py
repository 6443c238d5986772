"""Snapshots, forks and reset on the local backend: copy-on-write layers, for real."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
import time
from contextlib import contextmanager, suppress
import stat
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from orchard.agent.sandbox import FILE_CALLS_PER_SANDBOX
from orchard.agent.settings import AgentSettings
from orchard.agent.snapshots import MAX_LAYERS
from orchard.agent.runtimes.mounts import mounts_below
from orchard.errors import (
    AuthenticationFailed, InvalidRequest, OrchardError, QuotaExceeded, SandboxConflict, SandboxLost, SandboxNotFound,
    SnapshotNotFound, Unsupported,
)
from tests.backends.test_local_isolation import holder_pid, host_uid_of
from tests.conftest import TEST_STATE_DIR
from tests.images import busybox_rootfs

SNAPSHOTS = TEST_STATE_DIR / "snapshots"
DEEP_TREE = "cd /workspace && mkdir -p $(printf 'd/%.0s' $(seq 1500))"  # deeper than Python's recursion limit
# 3 x 701 directories deep, each path given shorter than PATH_MAX
TOO_DEEP_TO_HAND_OVER = ("cd /workspace && P=$(printf 'd/%.0s' $(seq 700)) && mkdir -p x1/$P x2/$P x3/$P && "
                         "mv x3 x2/$P && mv x2 x1/$P")


@contextmanager
def _agent(name: str, **settings: Any) -> Iterator[tuple[Any, AgentSettings]]:
    """A client on an agent of its own (settings the session's agent does not have)."""
    from orchard.backends.local.launcher import stop_agent
    from orchard.client import Client

    state_dir = Path(name if name.startswith("/") else f"/tmp/orchard-snap-{name}-{os.getpid()}")
    agent = AgentSettings(state_dir=state_dir, image_dirs=["/tmp"], **settings)
    client = Client(backend="local", backend_settings={"agent": agent.model_dump(mode="json")})
    try:
        yield client, agent
    finally:
        client.close()
        stop_agent(agent)
        shutil.rmtree(state_dir, ignore_errors=True)


def _emptied(client: Any) -> None:
    """Whatever a test left on an agent of its own (a failed test leaves sandboxes and snapshots)."""
    for sandbox in client.list():
        with suppress(SandboxNotFound):
            client.delete(sandbox.sandbox_id)
    for snapshot in client.list_snapshots():
        with suppress(SnapshotNotFound):
            client.delete_snapshot(snapshot.snapshot_id)


@pytest.fixture(scope="module")
def diskless_agent():
    with _agent("diskless", default_disk=None) as agent:
        yield agent


@pytest.fixture
def diskless(diskless_agent):
    """An agent whose sandboxes have no disk quota: their layers live on the host's disk."""
    yield diskless_agent
    _emptied(diskless_agent[0])


@pytest.fixture(scope="module")
def limited_agent():
    with _agent("limited", max_snapshots=2, max_snapshot_bytes="48Mi") as agent:
        yield agent


@pytest.fixture
def limited(limited_agent):
    yield limited_agent
    _emptied(limited_agent[0])


Call = tuple[str, str, Optional[dict]]


def _concurrently(agent: AgentSettings, calls: list[Call], lead: Optional[Call] = None) -> list[Any]:
    """Send requests to the agent all at once (after ``lead``, given a head start): each
    answer's body, or the typed error it raised."""
    from orchard.backends.local.launcher import ensure_agent
    from orchard.client.http import ApiClient

    endpoint = ensure_agent(AgentSettings(**agent.model_dump()))

    async def run() -> list[Any]:
        api = ApiClient(endpoint.url, endpoint.token, retries=0, timeout=300)

        async def one(method: str, path: str, body: Optional[dict]) -> Any:
            try:
                return await api.request(method, path, json_body=body)
            except OrchardError as exc:
                return exc

        try:
            first = asyncio.ensure_future(one(*lead)) if lead is not None else None
            if first is not None:
                await asyncio.sleep(0.5)
            answers = await asyncio.gather(*(one(*call) for call in calls))
            if first is not None:
                await first
            return answers
        finally:
            await api.close()

    return asyncio.run(run())


def _try_write(directory: int, name: str, data: bytes) -> Optional[int]:
    """Write a file through a directory descriptor: None, or the errno that refused it."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=directory)
    except OSError as exc:
        return exc.errno
    try:
        os.write(fd, data)
    except OSError as exc:
        return exc.errno
    finally:
        os.close(fd)
    return None


@pytest.fixture(scope="module")
def image():
    path = Path(f"/tmp/orchard-snapshots-{os.getpid()}")
    path.mkdir(mode=0o755, exist_ok=True)
    yield str(busybox_rootfs(path / "root"))
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def prepared(orchard_client, image):
    """A sandbox after 'setup': files written, one deleted from the image, a directory replaced."""
    sandbox = orchard_client.create(image)
    try:
        sandbox.exec("mkdir -p /workspace/repo/src && echo base > /workspace/repo/src/a.txt && rm /etc/os-release "
                     "&& rm -rf /usr/share && mkdir -p /usr/share/fresh && echo new > /usr/share/fresh/f", check=True)
        yield sandbox
    finally:
        with suppress(SandboxNotFound):  # some tests delete it themselves
            sandbox.delete()


def _read(sandbox, command: str) -> str:
    return sandbox.exec(command).stdout


def test_forks_start_from_the_snapshot_and_never_see_each_other(orchard_client, prepared, image):
    snapshot = prepared.snapshot()
    assert snapshot.image == image and snapshot.sandbox_id == prepared.id and snapshot.size_bytes > 0
    forks = orchard_client.fork(snapshot, 3)
    try:
        for n, fork in enumerate(forks):
            assert _read(fork, "cat /workspace/repo/src/a.txt") == "base\n"
            assert "No such file" in _read(fork, "ls /etc/os-release 2>&1"), "a file deleted before the snapshot"
            assert _read(fork, "ls /usr/share") == "fresh\n"  # a directory deleted and made again stays opaque
            fork.exec(f"echo fork-{n} > /workspace/repo/src/a.txt && rm -rf /workspace/repo/src/gone", check=True)
        assert [_read(fork, "cat /workspace/repo/src/a.txt") for fork in forks] == ["fork-0\n", "fork-1\n", "fork-2\n"]
        assert _read(prepared, "cat /workspace/repo/src/a.txt") == "base\n", "the source goes on from the snapshot"
        assert len({host_uid_of(fork) for fork in [*forks, prepared]}) == 4, "each fork has its own host uid"
    finally:
        for fork in forks:
            fork.delete()


def test_a_snapshot_stops_processes_and_the_sandbox_goes_on_with_its_files(orchard_client, prepared):
    prepared.exec("sleep 1000 >/dev/null 2>&1 &", check=True)
    assert "sleep 1000" in _read(prepared, "ps -o args")
    prepared.snapshot()
    assert "sleep 1000" not in _read(prepared, "ps -o args")
    assert _read(prepared, "cat /workspace/repo/src/a.txt") == "base\n"
    prepared.exec("echo after > /workspace/repo/after", check=True)  # writes go on, to a new layer


def test_the_frozen_layer_belongs_to_the_image_owner_not_to_the_sandbox_uid(orchard_client, prepared):
    uid = host_uid_of(prepared)
    snapshot = prepared.snapshot()
    layer = SNAPSHOTS / snapshot.snapshot_id / "layer" / "upper"
    entries = [layer, *layer.rglob("*")]
    whiteouts = [p for p in entries if stat.S_ISCHR(p.lstat().st_mode) and p.lstat().st_rdev == 0]
    assert whiteouts, "files deleted from the image are whiteouts in the layer"
    owners = {p.lstat().st_uid for p in entries if p not in whiteouts}
    assert uid not in owners and len(owners) == 1, owners
    assert (SNAPSHOTS.stat().st_mode & 0o777) == 0o700


def test_nested_snapshots_and_deferred_deletion(orchard_client, prepared):
    first = prepared.snapshot()
    [fork] = orchard_client.fork(first)
    fork.exec("echo second > /workspace/repo/second", check=True)
    second = fork.snapshot()
    assert second.parent == first.snapshot_id
    [grandchild] = orchard_client.fork(second.snapshot_id)
    assert _read(grandchild, "cat /workspace/repo/src/a.txt /workspace/repo/second") == "base\nsecond\n"
    orchard_client.delete_snapshot(first.snapshot_id)
    with pytest.raises(SnapshotNotFound):
        orchard_client.fork(first.snapshot_id)
    assert (SNAPSHOTS / first.snapshot_id).exists(), "kept while a snapshot stacked on it lives"
    assert _read(grandchild, "cat /workspace/repo/src/a.txt") == "base\n"
    orchard_client.delete_snapshot(second.snapshot_id)
    grandchild.delete()
    fork.delete()
    assert (SNAPSHOTS / first.snapshot_id).exists(), "the prepared sandbox still runs on the first snapshot"
    prepared.delete()
    assert not (SNAPSHOTS / first.snapshot_id).exists() and not (SNAPSHOTS / second.snapshot_id).exists()
    assert first.snapshot_id not in {s.snapshot_id for s in orchard_client.list_snapshots()}


def test_reset_drops_every_change_of_a_fork_and_of_a_plain_sandbox(orchard_client, prepared, image):
    snapshot = prepared.snapshot()
    [fork] = orchard_client.fork(snapshot)
    with fork:
        fork.exec("echo changed > /workspace/repo/src/a.txt && touch /new && sleep 1000 >/dev/null 2>&1 &", check=True)
        fork.reset()
        assert _read(fork, "cat /workspace/repo/src/a.txt; ls /new 2>&1; ps -o args | grep -c '[s]leep 1000'") == \
            "base\nls: /new: No such file or directory\n0\n"
    with orchard_client.create("host") as plain:
        plain.exec("echo x > /workspace/x", check=True)
        plain.reset()
        assert _read(plain, "ls /workspace") == ""


def test_snapshot_ids_are_idempotent_per_sandbox_and_errors_are_typed(orchard_client, prepared, image):
    first = prepared.snapshot("snap-fixed")
    assert prepared.snapshot("snap-fixed").snapshot_id == first.snapshot_id  # a retried call takes one snapshot
    with orchard_client.create(image) as other:
        with pytest.raises(SandboxConflict):
            other.snapshot("snap-fixed")
    with pytest.raises(SnapshotNotFound):
        orchard_client.fork("snap-never-taken")
    with pytest.raises(InvalidRequest, match="image"):
        orchard_client.create("host", snapshot="snap-fixed")
    with orchard_client.create("host") as host_view, pytest.raises(Unsupported, match="writable layer"):
        host_view.snapshot()
    with pytest.raises(ValueError):
        orchard_client.fork(first, 0)


def test_hostile_snapshot_content_stays_inside_the_forks(orchard_client, prepared):
    """Symlinks to host paths, hard links, FIFOs and set-uid files in a snapshot: the agent
    only changes owners by descriptor without following links, and forks see them as the
    sandbox's own, confined files."""
    marker = Path(f"/tmp/orchard-snapshot-host-file-{os.getpid()}")
    marker.write_text("host")
    os.chmod(marker, 0o644)
    before = marker.stat()
    try:
        prepared.exec(f"ln -s {marker} /workspace/link && ln -s / /workspace/rootlink && mkfifo /workspace/fifo && "
                      "cp /bin/busybox /workspace/id && chmod 4755 /workspace/id && "
                      "ln /workspace/repo/src/a.txt /workspace/hard", check=True)
        snapshot = prepared.snapshot()
        after = marker.stat()
        assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)
        [fork] = orchard_client.fork(snapshot)
        with fork:
            assert "No such file" in _read(fork, "cat /workspace/link 2>&1"), "a link resolves inside the fork"
            assert _read(fork, "/workspace/id -u") == "1000\n", "set-uid gives nothing"
            fork.exec("echo changed > /workspace/hard", check=True)
            assert _read(prepared, "cat /workspace/repo/src/a.txt") == "base\n"
            with pytest.raises(Exception):
                fork.download("/workspace/fifo")
    finally:
        marker.unlink()


def test_a_sandbox_too_deep_to_hand_over_is_refused_by_name(orchard_client, image):
    with orchard_client.create(image) as deep:
        # 3 x 701 directories deep, each path given shorter than PATH_MAX
        deep.exec("cd /workspace && P=$(printf 'd/%.0s' $(seq 700)) && mkdir -p x1/$P x2/$P x3/$P && "
                  "mv x3 x2/$P && mv x2 x1/$P", check=True, timeout=120)
        with pytest.raises(QuotaExceeded, match="deeper than"):
            deep.snapshot("snap-deep")
        with pytest.raises(SandboxLost, match="deeper than"):  # it was stopped to freeze it, and says why
            deep.exec("true", check=True)
    assert not (SNAPSHOTS / "snap-deep").exists()
    assert "snap-deep" not in {s.snapshot_id for s in orchard_client.list_snapshots()}


@pytest.mark.parametrize("suffix", ["snapshot", "snapshot%0A", "snapshot%0D", "snapshot%00", "snapshot%09"])
def test_a_per_sandbox_token_cannot_take_snapshots(prepared, agent_settings, suffix):
    """Also not with a control character after the route's name: Starlette's route regex ends
    in `$`, which matches before a trailing newline, while the token's scope compared names."""
    import httpx

    from orchard.agent.tokens import sandbox_token
    from orchard.backends.local.launcher import ensure_agent

    endpoint = ensure_agent(AgentSettings(**agent_settings.model_dump()))
    token = sandbox_token(endpoint.token, prepared.id, prepared.info.incarnation)
    url = endpoint.url
    transport = httpx.HTTPTransport(uds=url.removeprefix("unix://")) if url.startswith("unix://") else None
    with httpx.Client(transport=transport) as http:  # the bytes as given: %0A stays %0A on the wire
        answer = http.post(f"{'http://agent' if transport else url}/sandboxes/{prepared.id}/{suffix}", json={},
                           headers={"X-API-Key": token})
    assert answer.status_code == 401 and answer.json()["error"]["type"] == "AuthenticationFailed", answer.text
    assert _read(prepared, "cat /workspace/repo/src/a.txt") == "base\n"


@pytest.mark.parametrize("agent", ["quota", "diskless"])
def test_a_descriptor_kept_outside_the_sandbox_cannot_write_into_its_snapshot(request, agent, image, orchard_client):
    """A process outside the sandbox holding a descriptor into its overlay from before the
    snapshot (another sandbox on the host network namespace can be passed one over an
    abstract unix socket; here the test, through /proc/<holder>/root) wrote on into the
    frozen layer, and every fork saw it. The layer is sealed at the superblock (or copied)."""
    client = orchard_client if agent == "quota" else request.getfixturevalue("diskless")[0]
    with client.create(image) as source:
        source.exec("mkdir -p /workspace/kept && echo original > /workspace/kept/data", check=True)
        kept = os.open(f"/proc/{holder_pid(source)}/root/workspace/kept", os.O_RDONLY | os.O_DIRECTORY)
        try:
            snapshot = source.snapshot()
            refused = [_try_write(kept, "data", b"tampered\n"), _try_write(kept, "planted", b"planted\n")]
        finally:
            os.close(kept)
        [fork] = client.fork(snapshot)
        with fork:
            assert _read(fork, "cat /workspace/kept/data; ls /workspace/kept") == "original\ndata\n"
        assert _read(source, "cat /workspace/kept/data; ls /workspace/kept") == "original\ndata\n"
    if agent == "quota":  # the layer's own tmpfs, remounted read-only: the writes failed
        assert refused == [errno.EROFS, errno.EROFS]
    # else copied: the writes failed or landed in the discarded original, which no fork sees
    client.delete_snapshot(snapshot.snapshot_id)


def test_a_file_held_open_for_writing_outside_gets_the_layer_copied_whole(orchard_client, prepared):
    """The read-only remount is refused (EBUSY) while a file of the layer is open for
    writing outside the sandbox: the layer is then copied, and the writer writes into the
    discarded original. The copy keeps what an overlay layer means."""
    prepared.exec("echo original > /workspace/data && ln -s /workspace/data /workspace/link && "
                  "ln /workspace/data /workspace/hard && mkfifo /workspace/fifo && cp /bin/busybox /workspace/id && "
                  "chmod 4755 /workspace/id && truncate -s 100M /workspace/sparse && chmod 600 /workspace/data",
                  check=True)  # a sparse file: a copy that filled its holes would not fit its tmpfs
    writer = os.open(f"/proc/{holder_pid(prepared)}/root/workspace/data", os.O_WRONLY)
    try:
        snapshot = prepared.snapshot()
        with suppress(OSError):
            os.pwrite(writer, b"tampered", 0)
    finally:
        os.close(writer)
    [fork] = orchard_client.fork(snapshot)
    with fork:
        assert _read(fork, "cat /workspace/data /workspace/link /workspace/repo/src/a.txt") == \
            "original\noriginal\nbase\n"
        assert "No such file" in _read(fork, "ls /etc/os-release 2>&1"), "whiteouts are copied"
        assert _read(fork, "ls /usr/share") == "fresh\n", "so is an opaque directory's mark"
        assert _read(fork, "stat -c '%h %a %u' /workspace/data; stat -c %s /workspace/sparse; "
                           "test -p /workspace/fifo && echo fifo") == "2 600 1000\n104857600\nfifo\n"
        assert _read(fork, "/workspace/id -u") == "1000\n"
    [upper] = (SNAPSHOTS / snapshot.snapshot_id).glob("*/upper")
    assert os.statvfs(upper).f_flag & os.ST_RDONLY, "the copy is sealed too"


def test_a_snapshot_directory_holds_no_mount_but_its_layer(orchard_client, prepared):
    """The idmapped view of the image is a bind on the same filesystem, which
    os.path.ismount does not see: it stayed mounted inside every snapshot directory."""
    first = prepared.snapshot()
    [fork] = orchard_client.fork(first)
    with fork:
        second = fork.snapshot()
    for snapshot in (first, second):
        directory = SNAPSHOTS / snapshot.snapshot_id
        assert mounts_below(directory) == [directory / "layer"]


def test_snapshots_count_against_max_snapshot_bytes_and_a_refusal_changes_nothing(limited, image):
    """Snapshot layers stay in memory outside every sandbox's limit: their sum is bounded,
    checked before anything is frozen."""
    client, _ = limited
    with client.create(image) as sandbox:
        sandbox.exec("dd if=/dev/zero of=/workspace/first bs=1M count=32 2>/dev/null", check=True)
        first = sandbox.snapshot()
        assert first.size_bytes >= 32 << 20
        sandbox.exec("dd if=/dev/zero of=/workspace/second bs=1M count=32 2>/dev/null", check=True)
        sandbox.exec("sleep 1000 >/dev/null 2>&1 &", check=True)
        with pytest.raises(QuotaExceeded, match="max_snapshot_bytes"):
            sandbox.snapshot()
        assert "sleep 1000" in _read(sandbox, "ps -o args"), "a refusal stops nothing"
        assert _read(sandbox, "ls /workspace") == "first\nsecond\n"


def test_max_snapshots_holds_for_requests_arriving_together(limited, image):
    client, agent = limited
    sandboxes = [client.create(image) for _ in range(4)]
    answers = _concurrently(agent, [("POST", f"/sandboxes/{s.id}/snapshot", {}) for s in sandboxes])
    assert sorted(type(a).__name__ for a in answers) == ["QuotaExceeded", "QuotaExceeded", "dict", "dict"], answers
    assert len(client.list_snapshots()) == 2
    for sandbox in sandboxes:
        sandbox.exec("true", check=True)


def test_max_layers_holds_for_snapshots_of_one_sandbox_arriving_together(orchard_client, agent_settings, image):
    taken = []
    try:
        with orchard_client.create(image) as deep:
            for _ in range(MAX_LAYERS - 2):
                taken.append(deep.snapshot().snapshot_id)
            busy = ("POST", f"/sandboxes/{deep.id}/exec", {"command": "sleep 2", "wait": True})  # holds the lock
            answers = _concurrently(agent_settings, [("POST", f"/sandboxes/{deep.id}/snapshot", {})] * 3, lead=busy)
            taken += [a["snapshot_id"] for a in answers if isinstance(a, dict)]
            assert sorted(type(a).__name__ for a in answers) == ["QuotaExceeded", "dict", "dict"], answers
            deep.exec("true", check=True)
            parents = {s.snapshot_id: s.parent for s in orchard_client.list_snapshots()}
            depth, current = 0, taken[-1]
            while current is not None:
                depth, current = depth + 1, parents[current]
            assert depth == MAX_LAYERS
    finally:
        for snapshot_id in taken:
            orchard_client.delete_snapshot(snapshot_id)


def test_one_snapshot_id_asked_of_two_sandboxes_at_once(orchard_client, agent_settings, image):
    """The second asker got HTTP 500 and its sandbox was lost; now it is a conflict, and
    nothing of it was frozen."""
    with orchard_client.create(image) as first, orchard_client.create(image) as second:
        answers = _concurrently(agent_settings, [("POST", f"/sandboxes/{s.id}/snapshot", {"snapshot_id": "snap-twice"})
                                                 for s in (first, second)])
        assert sorted(type(a).__name__ for a in answers) == ["SandboxConflict", "dict"], answers
        for sandbox in (first, second):
            sandbox.exec("true", check=True)
    orchard_client.delete_snapshot("snap-twice")


def test_a_snapshot_whose_forks_could_not_mount_is_refused_before_freezing(image):
    """With a long state directory and the longest sandbox ids the overlay's options (one
    path per layer) outgrow a page before MAX_LAYERS: the restart after the freeze failed
    and the sandbox was lost. Now the snapshot is refused first, the sandbox untouched."""
    state_dir = f"/tmp/orchard-snap-long-{os.getpid()}-"
    with _agent(state_dir + "x" * (63 - len(state_dir))) as (client, _):
        taken = []
        with client.create(image, sandbox_id="s" * 63) as sandbox:
            sandbox.exec("echo kept > /workspace/kept", check=True)
            with pytest.raises(QuotaExceeded, match="mount options"):
                for _ in range(MAX_LAYERS):
                    taken.append(sandbox.snapshot().snapshot_id)
            assert 20 <= len(taken) < MAX_LAYERS - 1
            assert _read(sandbox, "cat /workspace/kept") == "kept\n"
            [fork] = client.fork(taken[-1], sandbox_id="f" * 63)  # the deepest snapshot taken still forks
            with fork:
                assert _read(fork, "cat /workspace/kept") == "kept\n"
        for snapshot_id in taken:
            client.delete_snapshot(snapshot_id)


def test_deep_trees_on_the_host_disk_are_snapshotted_and_removed(diskless, image):
    """With no disk quota the layers live on the host's disk, where removing a tree 1500
    directories deep recursed past Python's limit: HTTP 500s and sandboxes stuck."""
    client, agent = diskless
    with client.create(image) as sandbox:
        sandbox.exec(DEEP_TREE, check=True, timeout=120)
        snapshot = sandbox.snapshot()
        sandbox.exec(DEEP_TREE.replace("d/", "e/"), check=True, timeout=120)  # its own layer, removed on delete
        [fork] = client.fork(snapshot)
        with fork:
            assert _read(fork, "cd /workspace/$(printf 'd/%.0s' $(seq 1500)) && echo there") == "there\n"
    client.delete_snapshot(snapshot.snapshot_id)
    assert client.list() == [] and client.list_snapshots() == []
    assert os.listdir(agent.state_dir / "snapshots") == [] and os.listdir(agent.sandboxes_dir) == []


def test_a_diskless_sandbox_too_deep_to_hand_over_is_refused_untouched(diskless, image):
    """The refusal's clean-up recursed past Python's limit and left the sandbox restarting
    for ever; a layer on the host's disk is now measured before anything is stopped."""
    client, agent = diskless
    with client.create(image) as deep:
        deep.exec(TOO_DEEP_TO_HAND_OVER, check=True, timeout=120)
        with pytest.raises(QuotaExceeded, match="deeper than"):
            deep.snapshot("snap-deep")
        deep.exec("test -d /workspace/x1", check=True)
    assert client.list() == [] and client.list_snapshots() == []
    assert os.listdir(agent.state_dir / "snapshots") == [] and os.listdir(agent.sandboxes_dir) == []


def test_ids_that_are_no_url_segment_never_address_another_snapshot(orchard_client, prepared):
    """'snap-x#frag' reached the agent as /snapshots/snap-x (the rest a URL fragment) and
    deleted snap-x."""
    prepared.snapshot("snap-x")
    for wrong in ("snap-x#frag", "snap-x?y", ".."):
        with pytest.raises((InvalidRequest, SnapshotNotFound)):
            orchard_client.delete_snapshot(wrong)
    assert "snap-x" in {s.snapshot_id for s in orchard_client.list_snapshots()}
    orchard_client.delete_snapshot("snap-x")


def test_file_calls_queued_behind_a_snapshot_wait_for_it_or_say_why(image, agent_settings, orchard_client):
    """File calls waiting for one of the sandbox's slots while a snapshot stopped it ran
    against the old holder and answered 503; now they re-check the sandbox first."""
    from orchard.backends.local.launcher import ensure_agent

    endpoint = ensure_agent(AgentSettings(**agent_settings.model_dump()))
    path = endpoint.url.removeprefix("unix://")

    def send(request: str) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX)
        connection.connect(path)
        connection.sendall(request.encode())
        return connection

    def answer(connection: socket.socket) -> str:
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
        connection.close()
        return data.split(b"\r\n", 1)[0].decode()

    headers = f"Host: agent\r\nX-API-Key: {endpoint.token}\r\n"
    with orchard_client.create(image) as sandbox:
        sandbox.exec("mkdir /workspace/many && cd /workspace/many && seq 30000 | xargs touch", check=True, timeout=120)
        holder = holder_pid(sandbox)
        uploads = [send(f"PUT /sandboxes/{sandbox.id}/files/raw?path=/workspace/up{n} HTTP/1.1\r\n{headers}"
                        "Content-Type: application/octet-stream\r\nContent-Length: 100000000\r\n\r\n" + "x" * 1000)
                   for n in range(FILE_CALLS_PER_SANDBOX)]  # every slot of the sandbox taken
        time.sleep(1)
        queued = [send(f"GET /sandboxes/{sandbox.id}/files/list?path=/workspace HTTP/1.1\r\n{headers}"
                       "Connection: close\r\n\r\n") for _ in range(6)]
        time.sleep(0.5)
        snapshot = send(f"POST /sandboxes/{sandbox.id}/snapshot HTTP/1.1\r\n{headers}Content-Length: 0\r\n"
                        "Connection: close\r\n\r\n")
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{holder}") and time.monotonic() < deadline:
            time.sleep(0.001)
        for upload in uploads:  # the slots free up while the snapshot is under way
            upload.close()
        statuses = [answer(connection) for connection in queued]
        assert answer(snapshot).split()[1] == "200"
        assert all(status.split()[1] in ("200", "409") for status in statuses), statuses
        sandbox.exec("true", check=True)
    for taken in orchard_client.list_snapshots():
        if taken.sandbox_id == sandbox.id:
            orchard_client.delete_snapshot(taken.snapshot_id)


XATTR_PROBE = ("import errno, os\nopen('/workspace/x', 'w').close()\ntry:\n"
               "    os.setxattr('/workspace/x', 'user.hoard', b'z' * 60000)\n    print('set')\n"
               "except OSError as exc:\n    print('refused' if exc.errno == errno.EOPNOTSUPP else errno.errorcode[exc.errno])\n")


def test_extended_attributes_cannot_hold_data_outside_the_quota(orchard_client, kit_image):
    """tmpfs keeps user.* xattrs in kernel memory its size= does not count: 300 MiB a round
    went into a layer of disk: 16Mi while df showed 36 KB, and stayed in its snapshots."""
    for spec in ({"image": kit_image, "disk": "16Mi"}, {"image": "host", "disk": "16Mi"}):
        with orchard_client.create(**spec) as sandbox:
            assert sandbox.exec(["python3", "-c", XATTR_PROBE]).stdout.strip() == "refused", spec


def test_a_small_layer_holds_few_files_and_its_snapshot_counts_them(orchard_client, image):
    """A tmpfs's size= counts data pages only; each inode pins kernel memory beside them.
    The layer's inode count is bounded by its quota and a snapshot reports the inodes too."""
    with orchard_client.create(image, disk="16Mi") as small:
        made = small.exec("cd /workspace && i=0; while [ $i -lt 20000 ] && true > f$i 2>/dev/null; do i=$((i+1)); "
                          "done; echo $i").stdout.strip()
        assert 1000 <= int(made) <= (16 << 20) // 4096, made
        snapshot = small.snapshot()
        try:
            assert snapshot.size_bytes >= int(made) * 1024, snapshot  # inodes counted, though no data page is used
        finally:
            orchard_client.delete_snapshot(snapshot.snapshot_id)
