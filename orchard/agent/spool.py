"""Command output spooled to files, capped so a runaway command cannot exhaust memory.

Commands write straight into a file (a leftover background process can never hold a
pipe open and hang a call): an anonymous memfd, so no directory is touched on the hot
path and nothing is left behind. What is returned keeps the head and the tail; while
a command runs, the middle of a growing file is released with ``FALLOC_FL_PUNCH_HOLE``,
so even a flood of gigabytes holds only about ``2 * limit`` bytes. Pages are charged
to the memory cgroup of the writer, i.e. the sandbox that produced them.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_BLOCK = 4096
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


@dataclass
class Captured:
    text: str
    size: int
    truncated: bool


class SpoolFile:
    """One output stream of one job (stdout or stderr)."""

    def __init__(self, name: str, limit: int, fd: int = -1) -> None:
        """``fd``: a memfd made beforehand (a prestarted shell's output), now this file's."""
        self.limit = limit  # bytes kept: half from the head, half from the tail
        self.fd = fd if fd >= 0 else os.memfd_create(name, os.MFD_CLOEXEC)
        self.punched_to = 0
        self._seeker = -1  # our own description of the file, for SEEK_DATA (see data_from)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def release_middle(self, keep_from: int | None = None) -> None:
        """Punch out bytes between the head and the tail (and before ``keep_from``)."""
        size = self.size()
        if size < self.punched_to:  # the command truncated its output: punch what it writes anew
            self.punched_to = 0
        head = self.limit // 2
        end = size - self.limit // 2 if keep_from is None else min(keep_from, size - self.limit // 2)
        start = max(head, self.punched_to)
        start = (start + _BLOCK - 1) // _BLOCK * _BLOCK
        end = end // _BLOCK * _BLOCK
        if end - start >= 16 * _BLOCK:
            if _libc.fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start, end - start) == 0:
                self.punched_to = end

    def read_range(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def data_from(self, offset: int) -> tuple[int, int]:
        """The next stretch of bytes the command wrote, at or after ``offset``, as (start, end);
        (size, size) when only a hole follows. A hole (a truncate that grew the file, a punched
        middle) was never written and costs the command nothing to make; the kernel tells
        holes from data a page at a time. Sought through a description of our own: the
        command writes through the one we hold, at that description's offset."""
        try:
            if self._seeker < 0:
                self._seeker = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
            start = os.lseek(self._seeker, offset, os.SEEK_DATA)
            return start, os.lseek(self._seeker, start, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole from there to the end
                size = max(offset, self.size())
                return size, size
            return offset, self.size()  # no descriptor to spare (EMFILE): read on, holes and all

    def capture(self) -> Captured:
        size = self.size()
        if size <= self.limit:
            data = self.read_range(0, size)
            return Captured(data.decode("utf-8", "replace"), size, False)
        half = self.limit // 2
        head = self.read_range(0, half).decode("utf-8", "replace")
        tail = self.read_range(size - half, half).decode("utf-8", "replace")
        marker = f"\n[orchard: {size - 2 * half} bytes of output truncated]\n"
        return Captured(head + marker + tail, size, True)

    def close(self) -> None:
        if self._seeker >= 0:
            os.close(self._seeker)
            self._seeker = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
