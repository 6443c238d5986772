"""File calls resolved inside a sandbox's own root, never on the host.

Every path is opened with ``openat2(RESOLVE_IN_ROOT)`` relative to the sandbox's
root (``/proc/<holder>/root``), so ``..`` and absolute symlinks planted in the
sandbox stay inside it, while ordinary paths like ``/etc/hosts`` still work.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import Iterator

from orchard.errors import FileOperationFailed
from orchard.models import FileEntry

_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
# openat2 does not imply O_LARGEFILE the way open() does on 64-bit; its kernel value is per arch.
_O_LARGEFILE = {"x86_64": 0o100000, "aarch64": 0o400000, "ppc64le": 0o200000}.get(os.uname().machine, 0o100000)
_libc = ctypes.CDLL(None, use_errno=True)
MAX_FILE_BYTES = 512 << 20


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    if not flags & os.O_PATH:
        flags |= _O_LARGEFILE
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _explain(exc: OSError, path: str) -> FileOperationFailed:
    reasons = {
        errno.ENOENT: "no such file or directory",
        errno.ENOTDIR: "a component of the path is not a directory",
        errno.EISDIR: "is a directory",
        errno.EACCES: "permission denied",
        errno.EROFS: "read-only file system",
        errno.ENOSPC: "no space left (disk quota of the sandbox)",
        errno.EXDEV: "path escapes the sandbox",
        errno.ELOOP: "too many levels of symbolic links",
    }
    return FileOperationFailed(f"{path}: {reasons.get(exc.errno, exc.strerror)}")


@contextmanager
def acting_as(owner: tuple[int, int] | None) -> Iterator[None]:
    """Touch files with the sandbox's host ids (fsuid/fsgid, this thread only).

    A root agent cannot create inodes on a sandbox's own filesystems (its uid is
    unmapped there), and should not bypass the sandbox's permissions anyway.
    """
    if owner is None or os.geteuid() != 0:
        yield
        return
    _libc.setfsgid(owner[1])
    _libc.setfsuid(owner[0])
    try:
        yield
    finally:
        _libc.setfsuid(0)
        _libc.setfsgid(0)


class SandboxFiles:
    """Read, write and list files of one sandbox through its root directory."""

    def __init__(self, root: str, owner: tuple[int, int] | None, default_dir: str = "/") -> None:
        self.root = root
        self.owner = owner  # host uid/gid that file calls act as (the sandbox user's)
        self.default_dir = default_dir

    def _absolute(self, path: str) -> str:
        if "\0" in path:
            raise FileOperationFailed("path contains a NUL byte")
        joined = PurePosixPath(self.default_dir) / path
        return str(joined)

    def _open(self, path: str, flags: int, mode: int = 0) -> int:
        root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with acting_as(self.owner):
                return openat2(root_fd, path, flags, mode)
        finally:
            os.close(root_fd)

    def open_read(self, path: str) -> tuple[int, int]:
        """(fd, size) of a regular file, for reading in chunks; the caller closes fd."""
        full = self._absolute(path)
        try:
            fd = self._open(full, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as exc:
            raise _explain(exc, full) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise FileOperationFailed(f"{full}: not a regular file")
        return fd, info.st_size

    def read(self, path: str) -> bytes:
        fd, size = self.open_read(path)
        try:
            if size > MAX_FILE_BYTES:
                raise FileOperationFailed(f"{self._absolute(path)}: larger than {MAX_FILE_BYTES} bytes; "
                                          "download it with the raw files route")
            chunks, offset = [], 0
            while offset <= size:
                chunk = os.pread(fd, 8 << 20, offset)
                if not chunk:
                    break
                chunks.append(chunk)
                offset += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _make_parents(self, full: str) -> None:
        parent = PurePosixPath(full).parent
        for depth in range(1, len(parent.parts)):
            current = PurePosixPath(*parent.parts[: depth + 1])
            try:
                os.close(self._open(str(current), os.O_PATH | os.O_DIRECTORY))
                continue
            except FileNotFoundError:
                pass
            fd = self._open(str(current.parent), os.O_PATH | os.O_DIRECTORY)
            try:
                with acting_as(self.owner):
                    os.mkdir(current.name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            finally:
                os.close(fd)

    def open_write(self, path: str, mode: int | None = None) -> int:
        """A truncated regular file opened for writing (parents made); the caller closes it."""
        full = self._absolute(path)
        try:
            self._make_parents(full)
            fd = self._open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOCTTY, 0o644)
        except OSError as exc:
            raise _explain(exc, full) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FileOperationFailed(f"{full}: not a regular file")
            if mode is not None:
                os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write_chunk(self, fd: int, data: bytes, path: str) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:
            raise _explain(exc, self._absolute(path)) from None

    def write(self, path: str, data: bytes, mode: int | None = None) -> int:
        fd = self.open_write(path, mode)
        try:
            self.write_chunk(fd, data, path)
        finally:
            os.close(fd)
        return len(data)

    def list(self, path: str) -> list[FileEntry]:
        full = self._absolute(path)
        try:
            fd = self._open(full, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise _explain(exc, full) from None
        try:
            entries = []
            for name in sorted(os.listdir(fd)):
                try:
                    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                kind = ("directory" if stat.S_ISDIR(info.st_mode) else "file" if stat.S_ISREG(info.st_mode)
                        else "symlink" if stat.S_ISLNK(info.st_mode) else "other")
                entries.append(FileEntry(name=name, type=kind, size=info.st_size, modified=info.st_mtime))
            return entries
        finally:
            os.close(fd)

    def is_dir(self, path: str) -> bool:
        try:
            os.close(self._open(self._absolute(path), os.O_PATH | os.O_DIRECTORY))
            return True
        except OSError:
            return False

    def exists(self, path: str) -> bool:
        try:
            os.close(self._open(self._absolute(path), os.O_PATH))
            return True
        except OSError:
            return False
