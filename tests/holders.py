"""Finding a sandbox's holder (PID 1 of its namespaces) from the host, in tests."""

from __future__ import annotations

from pathlib import Path


def holder_with_marker(marker: str) -> int:
    """The host pid of the holder whose root has ``/tmp/<marker>``. Only PID 1 of the
    sandbox's PID namespace counts: the process the holder forks ahead of the next command
    runs the same binary in the same root."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_bytes().split(b"\0")[0] not in (b"/dev/.orchard-hold", b"/.orchard-hold"):
                continue
            nspid = [line for line in (entry / "status").read_text().splitlines() if line.startswith("NSpid:")]
            if nspid and nspid[0].split()[-1] == "1" and (entry / "root/tmp" / marker).exists():
                return int(entry.name)
        except OSError:
            continue
    raise LookupError(f"no holder with /tmp/{marker}")
