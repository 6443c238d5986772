"""The reconciler: compares the server's records with what the backend really has.

Each round: sandboxes past their heartbeat TTL or absolute lifetime are deleted, and
so are pending ones whose creating replica died (see ``ServerService.drop_abandoned``);
sandboxes the backend no longer has are marked lost with a reason; sandboxes the
backend has, labelled as this server's, but unknown to the store (orphans of a crash)
are deleted. If listing the backend fails or is slow, the round is skipped: nothing
is ever deleted on the strength of a failed call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from orchard.errors import StoreUnavailable
from orchard.server.config import ReconcilerSettings
from orchard.server.connections import ConnectionGuard
from orchard.server.service import OWNER_LABEL, ServerService

log = logging.getLogger("orchard.server.reconciler")
BYTES_PURGE_SECONDS = 30.0  # how often finished jobs are trimmed to job_retention_bytes


class Reconciler:
    def __init__(self, service: ServerService, settings: ReconcilerSettings,
                 connections: Optional[ConnectionGuard] = None) -> None:
        self.service = service
        self.settings = settings
        self.connections = connections  # a server turning callers away reaps nobody for a missed heartbeat
        self._task: Optional[asyncio.Task] = None
        self._bytes_purged_at = float("-inf")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval)
            try:
                await self.run_round()
            except StoreUnavailable as exc:  # expected while the store is away: no traceback each round
                self._count("round_failed", error=exc.message)
            except Exception:
                self.service.metrics.reconciler.labels("round_failed").inc()
                log.exception("reconciler round failed")
            self.service.metrics.reconciler.labels("round").inc()

    def _count(self, action: str, **fields: object) -> None:
        self.service.metrics.reconciler.labels(action).inc()
        log.info(action, extra={"fields": fields})

    async def run_round(self) -> None:
        service, settings = self.service, self.settings
        service.flush_heartbeats()
        if not service.store.lead("reconciler"):  # another replica reaps; two would delete twice
            return
        now = service.now()  # monotonic since start: a wall-clock step reaps nothing
        refusing = bool(settings.heartbeat_ttl and self.connections is not None
                        and self.connections.refused_within(settings.heartbeat_ttl))
        if refusing:
            self._count("heartbeats_not_reaped", reason="the server refused connections within heartbeat_ttl")
        for record in service.store.list_sandboxes():
            sandbox = record.sandbox
            expired = None
            if settings.heartbeat_ttl and now - record.last_seen > settings.heartbeat_ttl and not refusing:
                expired = f"no heartbeat for {settings.heartbeat_ttl:g}s"
            elif settings.max_lifetime and now - sandbox.created_at > settings.max_lifetime:
                expired = f"older than max_lifetime {settings.max_lifetime:g}s"
            pending = sandbox.status == "pending"
            abandoned = pending and now - sandbox.created_at > settings.lost_grace
            if ((expired and not pending) or abandoned) and not service.store.lead("reconciler"):
                return  # its store session was cut during the round: another replica may lead now
            if expired and not pending:
                try:
                    # Counted by the one call that removed the record: a replica whose store
                    # session was cut mid-delete may finish after the next leader reaped it too.
                    if await service.delete(sandbox.sandbox_id, reason=expired):
                        self._count("expired", sandbox_id=sandbox.sandbox_id, reason=expired)
                    else:
                        log.info("expired sandbox was already deleted", extra={"fields": {
                            "sandbox_id": sandbox.sandbox_id}})
                except Exception as exc:
                    log.warning("could not delete expired sandbox", extra={"fields": {
                        "sandbox_id": sandbox.sandbox_id, "error": str(exc)}})
            elif abandoned:
                try:  # a replica died creating it: nobody holds its id, nobody was told it exists
                    if await service.drop_abandoned(sandbox.sandbox_id):
                        self._count("abandoned_create_deleted", sandbox_id=sandbox.sandbox_id)
                except Exception as exc:
                    log.warning("could not drop an abandoned create", extra={"fields": {
                        "sandbox_id": sandbox.sandbox_id, "error": str(exc)}})
        try:
            await asyncio.wait_for(service.backend.maintain(), settings.list_timeout)
        except Exception as exc:  # housekeeping failing must not stop the reconciliation
            self._count("maintain_failed", error=f"{type(exc).__name__}: {exc}")
        # Only sandboxes already created before the listing can be missing from it: one whose
        # slow create ended during the listing is not lost (it was, when creates took longer
        # than lost_grace); the records are read again after it, for orphans and deletes.
        before = service.store.list_sandboxes()
        settled = {r.sandbox.sandbox_id for r in before if r.sandbox.status != "pending"}
        # An orphan has no record before the listing nor after it: one whose record went away
        # in between was deleted meanwhile (by another replica leading before this one, on a
        # shared store), and deleting it again would be counted as an orphan it never was.
        recorded_before = {r.sandbox.sandbox_id for r in before}
        try:
            live = {s.sandbox_id: s for s in await asyncio.wait_for(service.backend.list(), settings.list_timeout)}
        except Exception as exc:  # never act on a failed or partial listing
            self._count("list_failed", error=f"{type(exc).__name__}: {exc}")
            return
        known = {record.sandbox.sandbox_id: record for record in service.store.list_sandboxes()}
        if not service.store.lead("reconciler"):  # lost during the listing (a cut store session)
            return
        for sandbox_id, record in known.items():
            status = record.sandbox.status
            if status in ("lost", "pending") or sandbox_id not in settled \
                    or now - record.sandbox.created_at < settings.lost_grace:
                continue
            seen = live.get(sandbox_id)
            if seen is None:
                service.mark_lost(record, "the backend no longer has this sandbox (agent restarted, pod evicted, "
                                          "job cancelled or node lost)")
            elif seen.status == "lost":
                service.mark_lost(record, seen.status_message or "lost")
        for sandbox_id, seen in live.items():
            if seen.labels.get(OWNER_LABEL) == service.server_id and sandbox_id not in known \
                    and sandbox_id not in recorded_before:
                try:
                    await service.backend.delete(sandbox_id)
                    self._count("orphan_deleted", sandbox_id=sandbox_id)
                except Exception as exc:
                    log.warning("could not delete orphan", extra={"fields": {"sandbox_id": sandbox_id, "error": str(exc)}})
        # Finished jobs carry their agents' wall-clock completion times: the cutoff is on the
        # earlier of the wall clock and the server's, so a step either way purges no result early
        # (a result finished before a step back, or after a step forward, is kept a little longer).
        by_bytes = time.monotonic() - self._bytes_purged_at >= BYTES_PURGE_SECONDS  # a scan of every job: not each round
        service.store.purge_jobs(min(time.time(), now) - service.config.job_retention_seconds,
                                 service.config.job_retention_bytes if by_bytes else None)
        if by_bytes:
            self._bytes_purged_at = time.monotonic()
