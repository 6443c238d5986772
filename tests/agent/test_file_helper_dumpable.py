"""A file call's helper is never dumpable, whatever the host's fs.suid_dumpable says.

Dropping to the sandbox's uid makes a process non-dumpable only while fs.suid_dumpable is
0; some hosts set 1. A dumpable helper could be ptraced by the sandbox's own processes
(same uid, same user namespace), which could then write into the agent's end of the
call. The kernel shows the difference in /proc: a non-dumpable process's private entries
(environ, fd/, ...) are owned by root (of its user namespace, or of the host), a dumpable
one's by its own uid.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

SUID_DUMPABLE = Path("/proc/sys/fs/suid_dumpable")


def _helpers() -> list[int]:
    """File helpers that have settled, so a sighting is never of one still root on its way
    in: the one doing the call has seccomp on (applied after the id switch and the prctl),
    the one relaying its exit status has forked it (after both as well)."""
    status = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = (Path("/proc") / entry / "cmdline").read_bytes().split(b"\0")
            if b"--file" in argv and b"write" in argv:
                status[int(entry)] = (Path("/proc") / entry / "status").read_text()
        except OSError:
            continue
    parents = {int(line.split()[1]) for text in status.values() for line in text.splitlines() if line.startswith("PPid:")}
    return [pid for pid, text in status.items() if "\nSeccomp:\t2\n" in text or pid in parents]


def _owner_and_euid(pid: int) -> tuple[int, int]:
    status = (Path("/proc") / str(pid) / "status").read_text()
    euid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[2])
    return os.stat(f"/proc/{pid}/environ").st_uid, euid  # not /proc/PID itself: it always shows the euid


@pytest.mark.skipif(os.geteuid() != 0 or not SUID_DUMPABLE.exists(), reason="needs root to set fs.suid_dumpable")
def test_a_file_helper_is_not_dumpable_even_where_suid_dumpable_is_1(pty_agent):
    url, key, http = pty_agent
    created = http.post("/sandboxes", json={"image": "host"}).json()
    assert created["status"] == "ready", created
    sandbox_id = created["sandbox_id"]
    before = SUID_DUMPABLE.read_text().strip()
    try:
        SUID_DUMPABLE.write_text(before)
    except OSError as exc:  # a read-only /proc/sys (inside a container): nothing to set
        http.delete(f"/sandboxes/{sandbox_id}")
        pytest.skip(f"cannot set fs.suid_dumpable here: {exc}")
    release = threading.Event()
    done: dict = {}

    def slow_body():
        yield b"first piece\n"
        release.wait(30)  # the helper waits on the rest of the body meanwhile
        yield b"last piece\n"

    def upload() -> None:
        done["answer"] = http.put(f"/sandboxes/{sandbox_id}/files/raw", params={"path": "/tmp/slow.txt"},
                                  content=slow_body(), timeout=60)

    try:
        SUID_DUMPABLE.write_text("1")
        uploading = threading.Thread(target=upload)
        uploading.start()
        deadline = time.monotonic() + 20
        helpers: list[int] = []
        while len(helpers) < 2 and time.monotonic() < deadline:  # the call's process and its relay
            helpers = _helpers()
            time.sleep(0.02)
        assert helpers, "no file helper seen while the upload was open"
        owners = [_owner_and_euid(pid) for pid in helpers]
        release.set()
        uploading.join(30)
        assert done["answer"].status_code == 200, done["answer"].text
        written = http.get(f"/sandboxes/{sandbox_id}/files/raw", params={"path": "/tmp/slow.txt"})
        assert written.content == b"first piece\nlast piece\n"  # the upload itself still works
        for owner, euid in owners:
            assert euid != 0  # it runs as the sandbox's user ...
            assert owner != euid  # ... yet /proc does not give it to that user: not dumpable
    finally:
        release.set()
        SUID_DUMPABLE.write_text(before)
        http.delete(f"/sandboxes/{sandbox_id}")
