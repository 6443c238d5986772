"""Thin wrappers over mount(2)/umount2(2) for writable layers (overlayfs, tmpfs quotas)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
from pathlib import Path
from typing import Optional

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
_MS_RDONLY, _MS_REMOUNT = 1, 32
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
HOIST_DEPTH = 64  # removal keeps at most this many directories open; deeper ones are moved up first
_ESCAPED = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, backslash as \ooo
log = logging.getLogger("orchard.agent")

# Host-global /proc entries hidden inside sandboxes, as container runtimes mask them
# (an empty file or directory on top); /proc/sys is read-only.
MASKED_PROC_FILES = ("kcore", "kallsyms", "keys", "latency_stats", "sched_debug", "sysrq-trigger", "timer_list",
                     "timer_stats", "kpagecount", "kpageflags", "kpagecgroup", "config.gz")
MASKED_PROC_DIRS = ("acpi", "asound", "scsi", "firmware", "driver")


# Read-only host system directories a bubblewrap root may show (the ``host`` image, and the
# confined copy of a directory image); nothing else of the host.
HOST_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def system_binds() -> list[str]:
    """bubblewrap arguments showing the host's system directories read-only (merged-/usr
    symlinks as symlinks)."""
    args: list[str] = []
    for path in HOST_SYSTEM_PATHS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def mount(source: str, target: Path, fstype: str, options: str) -> None:
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def remount_read_only(target: Path) -> None:
    """Make the filesystem mounted at ``target`` read-only for good: a remount of its
    superblock (no MS_BIND), so writes through every mount of it, and through descriptors
    opened before, fail with EROFS. EBUSY while a file on it is open for writing."""
    if _libc.mount(None, str(target).encode(), None, _MS_REMOUNT | _MS_RDONLY, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"remount {target} read-only: {os.strerror(err)}")


def unmount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: already gone
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mounts_below(path: Path) -> list[Path]:
    """Mount points at or below ``path`` in our mount namespace, deepest first."""
    top = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = _ESCAPED.sub(lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point == top or point.startswith(top.rstrip("/") + "/"):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def remove_tree(path: Path) -> bool:
    """``rm -rf`` that never descends into a mount: whatever is mounted below ``path`` (a
    sandbox's overlay, its tmpfs, an idmapped view of a shared image) is detached first,
    and a tree that still holds a mount is left as it is. False when something was left.
    Removes by descriptor, without recursion: a tree written by hostile code may nest
    deeper than Python's stack or than PATH_MAX."""
    for point in mounts_below(path):
        try:
            unmount(point)
        except OSError as exc:
            log.warning("cannot unmount %s: %s", point, exc)
    remaining = mounts_below(path)
    if remaining:
        log.warning("left %s in place: still mounted below it: %s", path, ", ".join(map(str, remaining)))
        return False
    try:
        top = os.open(path, _DIRECTORY_FLAGS)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            return False
        try:  # a file or a symlink: rm -rf removes it too
            os.unlink(path)
        except OSError:
            return False
        return True
    try:
        clear_tree(top)
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def clear_tree(top: int) -> None:
    """Remove everything in the directory open at ``top`` (best effort, errors skipped),
    never crossing into another filesystem. Iterative, one descriptor per level; a
    directory deeper than HOIST_DEPTH is first moved up to ``top``, so neither the stack
    of descriptors nor any path grows with the tree's depth."""
    device = os.fstat(top).st_dev
    hoisted = 0
    stack: list[tuple[int, str, list[str]]] = [(top, "", _empty_files(top))]
    try:
        while stack:
            fd, name, directories = stack[-1]
            if not directories:
                stack.pop()
                if stack:
                    os.close(fd)
                    _ignore(os.rmdir, name, dir_fd=stack[-1][0])
                continue
            child = directories.pop()
            if len(stack) >= HOIST_DEPTH:
                hoisted, moved = _hoist(fd, child, top, hoisted)
                if moved is not None:
                    stack[0][2].append(moved)
                continue
            try:
                child_fd = os.open(child, _DIRECTORY_FLAGS, dir_fd=fd)
            except OSError:
                continue
            if os.fstat(child_fd).st_dev != device:  # a mount: never removed through
                os.close(child_fd)
                continue
            stack.append((child_fd, child, _empty_files(child_fd)))
    finally:
        for fd, _, _ in stack[1:]:
            os.close(fd)


def _hoist(fd: int, name: str, top: int, count: int) -> tuple[int, Optional[str]]:
    """Move directory ``name`` (in ``fd``) to ``top`` under a free name: (count, that name)."""
    for _ in range(1000):
        count += 1
        moved = f".orchard-removing-{count}"
        try:
            os.rename(name, moved, src_dir_fd=fd, dst_dir_fd=top)
            return count, moved
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):  # anything but a name taken
                return count, None
    return count, None


def _empty_files(fd: int) -> list[str]:
    """Unlink every entry of the directory open at ``fd`` but its subdirectories, which it returns."""
    try:
        with os.scandir(fd) as entries:
            listed = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    except OSError:
        return []
    directories = []
    for name, is_dir in listed:
        if is_dir:
            directories.append(name)
        else:
            _ignore(os.unlink, name, dir_fd=fd)
    return directories


def _ignore(call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except OSError:
        pass
