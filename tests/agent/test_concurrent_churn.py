"""Eight workers fork sandboxes from a snapshot, run commands, download a file, sometimes
reset, and delete, for half a minute: every call answers, and none with an internal error.

Session 11 moved the cgroup write of the spawner's prepared process into a thread pool; under
this churn the agent then found descriptors closed under it (commands failing with EBADF and
ESPIPE, uvloop refusing a pipe with EEXIST): 4 failures in 90 s of this loop on a quiet
machine, none without the thread. RL pipelines met it as aborted rollouts. The cause was a
double close in the file calls' plumbing (test_file_call_descriptors.py catches it directly);
this loop stays as the end-to-end check of the same churn.
"""

from __future__ import annotations

import asyncio
import random
import time

CHURN_SECONDS = 30


def test_forks_commands_file_calls_and_resets_at_once_never_fail_inside_the_agent(orchard_backend_settings,
                                                                                    kit_image):
    from orchard.client.aio import AsyncClient

    async def main() -> tuple[list, int]:
        failures: list = []
        rounds = 0
        async with AsyncClient(backend="local", backend_settings=orchard_backend_settings["local"]) as client:
            base = await client.create(kit_image)
            await base.exec("mkdir -p /workspace && echo hi > /workspace/f", check=True)
            snapshot = await base.snapshot()
            end = time.monotonic() + CHURN_SECONDS
            rng = random.Random(7)

            async def worker() -> None:
                nonlocal rounds
                while time.monotonic() < end:
                    [sandbox] = await client.fork(snapshot)
                    try:
                        for n in range(rng.randint(1, 6)):
                            job = await sandbox.exec(f"echo {n}; ls /workspace > /dev/null")
                            if job.exit_code != 0 or job.error_type is not None:
                                failures.append((job.error_type, job.error, job.stderr[-200:]))
                        if (await sandbox.download("/workspace/f")) != b"hi\n":
                            failures.append("download")
                        if rng.random() < 0.3:
                            await sandbox.reset()
                            if (await sandbox.exec("true")).exit_code != 0:
                                failures.append("after reset")
                    except Exception as exc:  # any error here is a failure of the agent under churn
                        failures.append(repr(exc)[:300])
                    finally:
                        await sandbox.delete()
                    rounds += 1

            await asyncio.gather(*(worker() for _ in range(8)))
            await client.delete_snapshot(snapshot.snapshot_id)
            await base.delete()
        return failures, rounds

    failures, rounds = asyncio.run(main())
    assert rounds >= 16, rounds  # the churn really happened
    assert failures == []
