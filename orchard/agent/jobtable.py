"""The agent's job records, kept for retries and polling, bounded in time and in bytes."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Optional

from orchard.agent.jobs import JobRecord
from orchard.errors import InvalidRequest
from orchard.models import JOB_ID_RULE, valid_job_id


class JobTable:
    """Finished jobs stay ``retention_seconds``, and the oldest are dropped first once
    their captured output passes ``retention_bytes`` (a busy agent must not grow forever)."""

    def __init__(self, retention_seconds: float, retention_bytes: int) -> None:
        self.retention_seconds = retention_seconds
        self.retention_bytes = retention_bytes
        self._records: dict[str, JobRecord] = {}
        self._by_sandbox: dict[str, set[str]] = {}
        self._finished: OrderedDict[str, int] = OrderedDict()  # job id -> bytes, oldest first
        self._finished_bytes = 0

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._records

    def get(self, job_id: str) -> Optional[JobRecord]:
        return self._records.get(job_id)

    def add(self, record: JobRecord) -> None:
        """Keep a new job; its id must be one a later ``GET /jobs/{id}`` can name (an
        ``Idempotency-Key`` header reaches here unchecked)."""
        job = record.job
        if not valid_job_id(job.job_id):
            raise InvalidRequest(f"job id (body job_id or Idempotency-Key header) {JOB_ID_RULE}; "
                                 f"got {job.job_id[:80]!r}")
        self._records[job.job_id] = record
        self._by_sandbox.setdefault(job.sandbox_id, set()).add(job.job_id)

    def finished(self, record: JobRecord) -> None:
        job = record.job
        if job.job_id not in self._records:
            return
        size = len(job.stdout) + len(job.stderr) + len(job.command)
        self._finished[job.job_id] = size
        self._finished_bytes += size
        while self._finished_bytes > self.retention_bytes and len(self._finished) > 1:
            self._forget(next(iter(self._finished)))

    def _forget(self, job_id: str) -> None:
        record = self._records.pop(job_id, None)
        self._finished_bytes -= self._finished.pop(job_id, 0)
        if record is not None:
            ids = self._by_sandbox.get(record.job.sandbox_id)
            if ids is not None:
                ids.discard(job_id)
                if not ids:
                    del self._by_sandbox[record.job.sandbox_id]

    def drop_sandbox(self, sandbox_id: str) -> None:
        """Forget a deleted sandbox's finished jobs (running ones end as lost, then expire)."""
        for job_id in list(self._by_sandbox.get(sandbox_id, ())):
            if job_id in self._finished:
                self._forget(job_id)

    def purge_expired(self) -> None:
        cutoff = time.monotonic() - self.retention_seconds
        while self._finished:
            job_id = next(iter(self._finished))
            record = self._records.get(job_id)
            if record is not None and record.finished_at >= cutoff:
                return
            self._forget(job_id)

    def running(self) -> int:
        return len(self._records) - len(self._finished)
