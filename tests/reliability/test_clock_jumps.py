"""TTL reaping must not follow the wall clock: an NTP step (or an operator's `date -s`)
of a day forward must not delete every live sandbox, and one backward must not keep
idle sandboxes for a day. The reconciler measures idleness on a clock anchored to the
wall clock once, at start, and advanced by the monotonic clock."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from orchard.models import Sandbox, SandboxSpec
from orchard.server.config import ReconcilerSettings, ServerConfig
from orchard.server.observability import Metrics
from orchard.server.reconciler import Reconciler
from orchard.server.service import OWNER_LABEL, ServerService
from orchard.server.store import SandboxRecord, SQLiteStore
from tests.listing_backend import ListingBackend

DAY = 86400.0


def make(tmp_path: Path, ttl: float):
    backend = ListingBackend()
    config = ServerConfig(state=tmp_path / "server.db", reconciler={"interval": 1, "heartbeat_ttl": ttl, "lost_grace": 0})
    service = ServerService(config, backend, SQLiteStore(config.state), Metrics())
    for sandbox_id in ("busy", "idle"):
        sandbox = Sandbox(sandbox_id=sandbox_id, image="host", status="ready", backend="fake", created_at=time.time(),
                          labels={OWNER_LABEL: service.server_id})
        backend.live[sandbox_id] = sandbox
        service.store.put_sandbox(SandboxRecord(SandboxSpec(sandbox_id=sandbox_id), sandbox, service.now()))
    return service, backend, Reconciler(service, ReconcilerSettings(interval=1, heartbeat_ttl=ttl, lost_grace=0))


def test_a_wall_clock_jump_forward_reaps_nothing(tmp_path, monkeypatch):
    service, backend, reconciler = make(tmp_path, ttl=600)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + DAY)  # the clock is stepped a day ahead
    service.touch("busy")
    asyncio.run(reconciler.run_round())
    assert backend.deleted == []
    assert {r.sandbox.sandbox_id for r in service.store.list_sandboxes()} == {"busy", "idle"}
    service.store.close()


def test_a_wall_clock_jump_backward_still_reaps_on_time(tmp_path, monkeypatch):
    service, backend, reconciler = make(tmp_path, ttl=0.5)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - DAY)  # the clock is stepped a day back
    deadline = time.monotonic() + 10
    while "idle" not in backend.deleted:
        assert time.monotonic() < deadline, "the idle sandbox was not reaped within its TTL"
        service.touch("busy")
        asyncio.run(reconciler.run_round())
        time.sleep(0.1)
    assert "busy" not in backend.deleted
    service.store.close()


@pytest.mark.parametrize("step", [DAY, -DAY])
def test_the_service_clock_is_monotonic_after_start(tmp_path, monkeypatch, step):
    service, _, _ = make(tmp_path, ttl=600)
    before = service.now()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + step)
    assert 0 <= service.now() - before < 5
    service.store.close()


def test_max_lifetime_and_lost_grace_use_the_servers_clock(tmp_path, monkeypatch):
    """A backend stamps created_at with its own wall clock; the server keeps its own, so a
    step of the host's clock neither ends sandboxes early nor hides lost ones for a day."""
    service, backend, _ = make(tmp_path, ttl=600)
    reconciler = Reconciler(service, ReconcilerSettings(interval=1, heartbeat_ttl=None, max_lifetime=3600, lost_grace=5))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - DAY)  # records made before a step back
    backend.live.pop("idle")  # and the backend lost one
    for record in service.store.list_sandboxes():  # made long enough ago to be past the grace
        record.sandbox = record.sandbox.model_copy(update={"created_at": service.now() - 10})
        service.store.put_sandbox(record)
    asyncio.run(reconciler.run_round())
    assert backend.deleted == []
    assert service.store.get_sandbox("idle").sandbox.status == "lost"
    assert service.store.get_sandbox("busy").sandbox.status == "ready"
    service.store.close()


@pytest.mark.parametrize("step", [DAY, -DAY])
def test_a_wall_clock_step_purges_no_fresh_job_result(tmp_path, monkeypatch, step):
    """Finished jobs carry their agent's wall-clock completion time; a result finished
    seconds ago (before or after the step) must outlive job_retention_seconds (3600)."""
    from orchard.models import Job

    service, _, reconciler = make(tmp_path, ttl=600)
    real = time.time
    before = Job(job_id="before", sandbox_id="busy", command="true", status="succeeded", created_at=real() - 10,
                 completed_at=real() - 5)
    service.store.put_job(before)
    monkeypatch.setattr(time, "time", lambda: real() + step)
    after = Job(job_id="after", sandbox_id="busy", command="true", status="succeeded", created_at=time.time() - 10,
                completed_at=time.time() - 5)
    service.store.put_job(after)
    service.touch("busy")
    service.touch("idle")
    asyncio.run(reconciler.run_round())
    assert service.store.get_job("before") is not None and service.store.get_job("after") is not None
    service.store.close()
