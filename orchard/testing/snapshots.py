"""Kit tests of the optional snapshot and reset capabilities: a backend either does them
right (forks start from the snapshot's files and never see each other; reset drops every
change) or refuses with ``Unsupported``, saying what it cannot do. Never half of it."""

from __future__ import annotations

import pytest

from orchard.errors import SnapshotNotFound, Unsupported


def test_snapshots_fork_correctly_or_are_refused_by_name(orchard_client, orchard_image):
    with orchard_client.create(orchard_image) as source:
        source.exec("mkdir -p kit-snapshot && echo base > kit-snapshot/f", check=True)
        try:
            snapshot = source.snapshot()
        except Unsupported as exc:
            assert "snapshot" in str(exc)
            return
        forks = orchard_client.fork(snapshot, 2)
        try:
            for n, fork in enumerate(forks):
                assert fork.exec("cat kit-snapshot/f").stdout == "base\n"
                fork.exec(f"echo fork-{n} > kit-snapshot/f", check=True)
            assert [f.exec("cat kit-snapshot/f").stdout for f in forks] == ["fork-0\n", "fork-1\n"]
            assert source.exec("cat kit-snapshot/f").stdout == "base\n"
            assert snapshot.snapshot_id in {s.snapshot_id for s in orchard_client.list_snapshots()}
        finally:
            for fork in forks:
                fork.delete()
        orchard_client.delete_snapshot(snapshot.snapshot_id)
        with pytest.raises(SnapshotNotFound):
            orchard_client.fork(snapshot.snapshot_id)


def test_reset_restores_the_start_or_is_refused_by_name(orchard_client, orchard_image):
    with orchard_client.create(orchard_image) as sandbox:
        sandbox.exec("mkdir -p kit-reset && echo changed > kit-reset/f", check=True)
        try:
            sandbox.reset()
        except Unsupported as exc:
            assert "reset" in str(exc)
            return
        assert sandbox.exec("ls kit-reset 2>/dev/null | wc -l").stdout.strip() == "0"
        assert sandbox.exec("echo alive").stdout == "alive\n"
