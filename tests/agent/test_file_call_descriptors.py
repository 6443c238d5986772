"""File calls never close a descriptor twice.

A file call's pipe used to be handed to uvloop as a Python file object: uvloop closes the
descriptor itself and then closes the file object too, a second close(2) of the same number.
A descriptor another thread opened in between (the spawner's cgroup move, a snapshot's copy)
was closed under it or swapped for another: commands failed with EBADF or ESPIPE. Here the
real plumbing (``SandboxFiles._start``, on uvloop, with the agent's reaper) runs beside two
threads that open, check and close ``/dev/null``; the old plumbing failed this within 37-409
calls in six runs. The "helper" is a TEST DOUBLE: ``cat`` instead of ``orchard-enter --file``,
since only the descriptors around it are under test. It runs in a child process, because the
reaper makes its process a subreaper.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CALLS = 1000

SCRIPT = textwrap.dedent("""
    import asyncio, os, sys, threading
    import uvloop
    from orchard.agent.files import SandboxFiles
    from orchard.agent.reaper import ChildReaper

    class CatRuntime:  # the test double: what the helper runs
        def file_command(self, sandbox, op):
            return ["/bin/cat"]

    async def main(calls):
        reaper = ChildReaper()
        reaper.install(asyncio.get_running_loop())
        files = SandboxFiles(CatRuntime(), None, reaper, asyncio.Semaphore(8))
        stop, errors = threading.Event(), []
        null = os.stat("/dev/null").st_rdev

        def opener():
            while not stop.is_set():
                fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if os.fstat(fd).st_rdev != null:
                        errors.append("swapped")
                    os.close(fd)
                except OSError as exc:
                    errors.append(exc.strerror)

        threads = [threading.Thread(target=opener, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        done = 0
        for n in range(calls):
            run = await files._start(["write"], with_stdin=True)
            run.stdin.write(b"%d" % n)
            await run.stdin.drain()
            run.stdin.close()
            assert await run.stdout.read() == b"%d" % n and await run.exited == 0
            run.close()
            done += 1
            if errors:
                break
        stop.set()
        for thread in threads:
            thread.join()
        print(done, errors[:3])

    uvloop.run(main(int(sys.argv[1])))
""")


def test_file_calls_never_close_a_descriptor_another_thread_opened():
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(CALLS)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == f"{CALLS} []", result.stdout
