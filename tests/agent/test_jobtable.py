"""Job retention: bounded by time and by captured bytes, per-sandbox cleanup."""

import asyncio
import time

from orchard.agent.jobs import JobRecord
from orchard.agent.jobtable import JobTable
from orchard.models import ExecRequest, Job


def record(job_id: str, sandbox_id: str = "s", output: str = "") -> JobRecord:
    job = Job(job_id=job_id, sandbox_id=sandbox_id, command="c", status="succeeded", stdout=output, created_at=0)
    rec = JobRecord(job=job, request=ExecRequest(command="c"))
    rec.finished_at = time.monotonic()
    return rec


def test_oldest_finished_jobs_go_first_when_bytes_run_out():
    async def main():
        table = JobTable(retention_seconds=3600, retention_bytes=250)
        for i in range(5):
            rec = record(f"j{i}", output="x" * 99)
            table.add(rec)
            table.finished(rec)
        assert [f"j{i}" in table for i in range(5)] == [False, False, False, True, True]
        running = record("r")
        table.add(running)
        assert table.running() == 1
    asyncio.run(main())


def test_expiry_and_sandbox_drop():
    async def main():
        table = JobTable(retention_seconds=0.05, retention_bytes=10**9)
        a, b = record("a", "s1"), record("b", "s2")
        for rec in (a, b):
            table.add(rec)
            table.finished(rec)
        table.drop_sandbox("s1")
        assert "a" not in table and "b" in table
        time.sleep(0.1)
        table.purge_expired()
        assert "b" not in table
    asyncio.run(main())
