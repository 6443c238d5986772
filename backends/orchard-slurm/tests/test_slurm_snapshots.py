"""Snapshots on Slurm pilots: the pilot's agent freezes the layer, forks run on that pilot."""

from __future__ import annotations

import pytest

from orchard.errors import QuotaExceeded

from slurm_testing import slurm_client, slurm_settings


def test_forks_run_on_the_pilot_that_keeps_their_snapshot(slurm_cluster, kit_image):
    settings = slurm_settings(sandboxes_per_pilot=2, max_pilots=2, pilot_idle_seconds=0)
    settings["image_dirs"].append(str(kit_image.parent))
    with slurm_client(settings) as client:
        backend = client._inner.backend
        with client.create(str(kit_image)) as source:
            source.exec("echo prepared > /workspace/state", check=True)
            snapshot = source.snapshot()
            [fork] = client.fork(snapshot)
            with fork:
                assert backend.pool.owner[fork.id] == backend.pool.owner[source.id]
                assert fork.exec("cat /workspace/state").stdout == "prepared\n"
                with pytest.raises(QuotaExceeded, match="keeps snapshot"):  # its pilot is full (2 per pilot)
                    client.fork(snapshot)
                with client.create(str(kit_image)) as elsewhere:  # plain creates still go to another pilot
                    assert backend.pool.owner[elsewhere.id] != backend.pool.owner[source.id]
                fork.exec("echo changed > /workspace/state", check=True)
                fork.reset()
                assert fork.exec("cat /workspace/state").stdout == "prepared\n"
            client.delete_snapshot(snapshot.snapshot_id)
        client._portal.call(backend.shutdown())
