"""Two replicas on one shared store, their reconciler rounds interleaved at the awaits where
a real backend call yields: what one replica deletes while the other is mid-round is reaped
once, counted once, and never called an orphan. (PostgreSQL replicas meet these orders when a
leader's store session is cut mid-round and the other replica takes the lead; here the two
replicas share one SQLite file, so the order is chosen, not waited for.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from orchard.models import Sandbox, SandboxSpec
from orchard.server.config import ReconcilerSettings, ServerConfig
from orchard.server.observability import Metrics
from orchard.server.reconciler import Reconciler
from orchard.server.service import OWNER_LABEL, ServerService
from orchard.server.store import SandboxRecord, SQLiteStore
from tests.listing_backend import ListingBackend


def replica(state: Path, backend: ListingBackend, ttl: float) -> tuple[ServerService, Reconciler]:
    settings = {"interval": 1, "heartbeat_ttl": ttl, "lost_grace": 0}
    config = ServerConfig(state=state, reconciler=settings)
    service = ServerService(config, backend, SQLiteStore(state), Metrics())
    return service, Reconciler(service, ReconcilerSettings(**settings))


def two_replicas(tmp_path: Path, ttl: float):
    backend = ListingBackend()
    first, second = (replica(tmp_path / "server.db", backend, ttl) for _ in range(2))
    sandbox = Sandbox(sandbox_id="idle", image="host", status="ready", backend="fake", created_at=time.time() - 60,
                      labels={OWNER_LABEL: first[0].server_id})
    backend.live["idle"] = sandbox
    first[0].store.put_sandbox(SandboxRecord(SandboxSpec(sandbox_id="idle"), sandbox, first[0].now() - 60))
    return backend, first, second


def actions(service: ServerService, action: str) -> float:
    return service.metrics.reconciler.labels(action)._value.get()


def test_a_sandbox_reaped_by_two_replicas_at_once_is_counted_once(tmp_path):
    """The first replica is mid-delete (its backend call awaiting) when the second one's round
    reaps the same idle sandbox: both deletes reach the backend, one record is removed, and
    exactly one replica counts it expired."""
    backend, (first, first_round), (second, second_round) = two_replicas(tmp_path, ttl=1.0)

    async def second_replica_reaps(_: str) -> None:
        await second_round.run_round()

    backend.during_delete = second_replica_reaps
    asyncio.run(first_round.run_round())
    assert backend.deleted == ["idle", "idle"]  # the second replica's, then the first's
    assert first.store.list_sandboxes() == []
    assert actions(second, "expired") == 1 and actions(first, "expired") == 0
    assert actions(first, "orphan_deleted") == actions(second, "orphan_deleted") == 0


def test_a_sandbox_deleted_during_the_listing_is_not_an_orphan(tmp_path):
    """The backend listed the sandbox, then another replica deleted it and its record before
    this replica read the records again: it was deleted, not orphaned."""
    backend, (first, first_round), (second, _) = two_replicas(tmp_path, ttl=3600)

    async def deleted_meanwhile() -> None:
        backend.during_list = None
        assert await second.delete("idle")

    backend.during_list = deleted_meanwhile
    asyncio.run(first_round.run_round())
    assert backend.deleted == ["idle"]  # the other replica's delete only
    assert actions(first, "orphan_deleted") == 0
