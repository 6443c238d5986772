"""Snapshots, forks and reset on the local backend: copy-on-write layers, for real."""

from __future__ import annotations

import os
import shutil
from contextlib import suppress
import stat
from pathlib import Path

import pytest

from orchard.agent.settings import AgentSettings
from orchard.errors import (
    AuthenticationFailed, InvalidRequest, QuotaExceeded, SandboxConflict, SandboxLost, SandboxNotFound, SnapshotNotFound, Unsupported,
)
from tests.backends.test_local_isolation import host_uid_of
from tests.conftest import TEST_STATE_DIR
from tests.images import busybox_rootfs

SNAPSHOTS = TEST_STATE_DIR / "snapshots"


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


def test_a_per_sandbox_token_cannot_take_snapshots(prepared, agent_settings):
    from orchard.agent.tokens import sandbox_token
    from orchard.backends.local.launcher import ensure_agent
    from orchard.client.http import ApiClient
    import asyncio

    endpoint = ensure_agent(AgentSettings(**agent_settings.model_dump()))
    token = sandbox_token(endpoint.token, prepared.id, prepared.info.incarnation)

    async def call() -> None:
        api = ApiClient(endpoint.url, token, retries=0)
        try:
            await api.request("POST", f"/sandboxes/{prepared.id}/snapshot", json_body={})
        finally:
            await api.close()

    with pytest.raises(AuthenticationFailed):
        asyncio.run(call())
    assert _read(prepared, "cat /workspace/repo/src/a.txt") == "base\n"
