"""Probe (session 20): how much of `bash -c true` a bash started ahead of its command takes off
the command's path. (a) posix_spawn `bash -c true` and wait; (b) a bash started beforehand and
blocked reading its command from a pipe on descriptor 3, timed from writing the command to
its exit. Not a benchmark of Orchard: the step a spawner change would start from.

    python3 docs/probes/prestarted_bash.py [N]
"""
import os
import statistics
import sys
import time

WRAPPER = 'IFS= read -r -d "" c <&3; exec 3<&-; eval "$c"'


def cold() -> float:
    started = time.perf_counter()
    os.waitpid(os.posix_spawn("/bin/bash", ["bash", "-c", "true"], os.environ), 0)
    return time.perf_counter() - started


def prestarted() -> float:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(read_end, 3)
        os.set_inheritable(3, True)
        os.close(write_end)
        os.execv("/bin/bash", ["bash", "-c", WRAPPER, "bash"])
    os.close(read_end)
    time.sleep(0.01)  # loaded, and blocked in its read
    started = time.perf_counter()
    os.write(write_end, b"true\0")
    os.close(write_end)
    os.waitpid(pid, 0)
    return time.perf_counter() - started


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    for name, run in (("bash -c true, started for the command", cold), ("bash started ahead of it", prestarted)):
        times = sorted(run() for _ in range(n))
        print(f"{name}: p50 {statistics.median(times) * 1e3:.3f} ms, p90 {times[int(0.9 * n)] * 1e3:.3f} ms")
