"""Frozen layers made unwritable for good, whoever still holds a descriptor into them.

Stopping a sandbox does not stop every writer of its layer: a process outside it may hold
a descriptor into its overlay (another sandbox on the host network namespace can be
passed one over an abstract unix socket), and the overlay, detached but alive, writes on
into the upper directory, the snapshot every fork stacks. So the layer is sealed at the
superblock: its tmpfs is remounted read-only, and every write through any mount of it or
any descriptor opened before fails with EROFS. When that is refused (a file on it is
still open for writing somewhere), or the layer is no mount of its own (no disk quota),
the layer is copied into a fresh tree (on a tmpfs sized to it, sealed the same way) and
the original is discarded: old descriptors then point into a tree no fork sees.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from orchard.agent.runtimes.mounts import clear_tree, mount, remount_read_only, remove_tree
from orchard.agent.snapshots import INODE_BYTES, MAX_TREE_DEPTH, tree_size
from orchard.errors import QuotaExceeded

log = logging.getLogger("orchard.agent")
MAX_KEPT_LINKS = 65536  # hard-linked files a copy keeps linked (one descriptor each); more are copied apart
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CHUNK = 1 << 20


def layer_usage(layer: Path) -> int:
    """The bytes a sandbox's writable layer (``layer``, holding ``upper``) holds now: on its
    tmpfs, the data pages and the inode space in use (inodes and extended attributes, which
    pin kernel memory that the data count leaves out), else a walk of its upper directory."""
    if os.path.ismount(layer):
        info = os.statvfs(layer)
        return (info.f_blocks - info.f_bfree) * info.f_frsize + (info.f_files - info.f_ffree) * INODE_BYTES
    return tree_size(layer / "upper")


def seal(directory: Path, size: int) -> Path:
    """Make the frozen layer in ``directory/layer`` unwritable by anyone; ``size``: the bytes
    it holds. Returns the upper directory the snapshot stacks: ``layer/upper``, or
    ``copy/upper`` when it had to be copied."""
    layer = directory / "layer"
    if os.path.ismount(layer):
        try:
            remount_read_only(layer)
            return layer / "upper"
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            log.warning("%s is busy (a file of it open for writing, or deleted but open, outside its sandbox): "
                        "copying the layer", layer)
    copy = directory / "copy"
    copy.mkdir(mode=0o700)
    try:
        mount("tmpfs", copy, "tmpfs", f"size={size + (1 << 20) + size // 64},mode=0700")
        on_tmpfs = True
    except OSError as exc:
        log.warning("snapshot copy of %s stays on the state directory's filesystem: %s", layer, exc)
        on_tmpfs = False
    source = os.open(layer / "upper", _DIRECTORY)
    try:
        (copy / "upper").mkdir(mode=0o700)  # given the original's owner, mode and attributes below
        target = os.open(copy / "upper", _DIRECTORY)
        try:
            copy_tree(source, target)
        finally:
            os.close(target)
        clear_tree(source)  # frees the original's memory even while a descriptor keeps it alive
    finally:
        os.close(source)
    if on_tmpfs:
        remount_read_only(copy)
    remove_tree(layer)
    return copy / "upper"


def copy_tree(source: int, target: int) -> None:
    """Copy the directory open at ``source`` into the empty one open at ``target``, as an
    overlay layer needs it: owners, modes (set-id bits too), times, extended attributes
    (``trusted.overlay.*`` marks opaque directories), whiteouts (0/0 character devices),
    symlinks, FIFOs, sockets, hard links and holes. By descriptor and without recursion,
    never following a symlink; entries that change type or vanish meanwhile are skipped."""
    links: dict[tuple[int, int], int] = {}
    root = os.fstat(source)
    _copy_attributes(source, target, root)
    stack: list[tuple[int, int, os.stat_result, list[tuple[str, os.stat_result]]]] = [
        (source, target, root, _copy_entries(source, target, links))]
    try:
        while stack:
            src, dst, info, directories = stack[-1]
            if not directories:
                os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns))  # after its entries changed it
                stack.pop()
                if stack:
                    os.close(src)
                    os.close(dst)
                continue
            name, _ = directories.pop()
            try:
                child = os.open(name, _DIRECTORY, dir_fd=src)
            except (FileNotFoundError, NotADirectoryError):
                continue
            try:
                child_info = os.fstat(child)
                if len(stack) >= MAX_TREE_DEPTH:
                    raise QuotaExceeded(f"the sandbox's files nest deeper than {MAX_TREE_DEPTH} directories; "
                                        "cannot snapshot it")
                os.mkdir(name, 0o700, dir_fd=dst)
                copied = os.open(name, _DIRECTORY, dir_fd=dst)
            except BaseException:
                os.close(child)
                raise
            try:
                _copy_attributes(child, copied, child_info)
                entries = _copy_entries(child, copied, links)
            except BaseException:
                os.close(child)
                os.close(copied)
                raise
            stack.append((child, copied, child_info, entries))
    finally:
        for src, dst, _, _ in stack[1:]:
            os.close(src)
            os.close(dst)
        for fd in links.values():
            os.close(fd)


def _copy_entries(src: int, dst: int, links: dict[tuple[int, int], int]) -> list[tuple[str, os.stat_result]]:
    """Copy every entry of ``src`` into ``dst`` but subdirectories, which it returns."""
    directories = []
    with os.scandir(src) as entries:
        listed = list(entries)
    for entry in listed:
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        name, mode = entry.name, info.st_mode
        if stat.S_ISDIR(mode):
            directories.append((name, info))
        elif stat.S_ISREG(mode):
            _copy_file(src, dst, name, info, links)
        elif stat.S_ISLNK(mode):
            try:
                os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.EINVAL):  # vanished, or no longer a symlink
                    raise
                continue
            os.chown(name, info.st_uid, info.st_gid, dir_fd=dst, follow_symlinks=False)
            _copy_xattrs_by_name(src, dst, name)
            os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
        elif stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (stat.S_ISCHR(mode) and info.st_rdev == 0):
            os.mknod(name, stat.S_IFMT(mode) | 0o600, 0, dir_fd=dst)  # 0/0 character devices: whiteouts
            os.chown(name, info.st_uid, info.st_gid, dir_fd=dst, follow_symlinks=False)
            os.chmod(name, stat.S_IMODE(mode), dir_fd=dst)  # ours, just made: no symlink to follow
            _copy_xattrs_by_name(src, dst, name)
            os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
        else:  # a device node: no sandbox can make one (its user namespace has no CAP_MKNOD)
            log.warning("not copying device node %r into a snapshot", name)
    return directories


def _copy_file(src_dir: int, dst_dir: int, name: str, info: os.stat_result, links: dict[tuple[int, int], int]) -> None:
    key = (info.st_dev, info.st_ino)
    if info.st_nlink > 1 and key in links:
        os.link(f"/proc/self/fd/{links[key]}", name, dst_dir_fd=dst_dir, follow_symlinks=True)
        return
    try:
        src = os.open(name, _FILE, dir_fd=src_dir)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):  # vanished, or no longer a file
            return
        raise
    try:
        info = os.fstat(src)
        if not stat.S_ISREG(info.st_mode):
            return
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst_dir)
        try:
            _copy_data(src, dst, info.st_size)
            _copy_attributes(src, dst, info)
            if info.st_nlink > 1 and len(links) < MAX_KEPT_LINKS:
                links[key] = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dst_dir)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_data(src: int, dst: int, size: int) -> None:
    """Copy ``size`` bytes, holes kept as holes (a sparse file stays sparse)."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole up to the end
                break
            raise
        end = min(os.lseek(src, start, os.SEEK_HOLE), size)
        while start < end:
            try:
                done = os.copy_file_range(src, dst, end - start, start, start)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                done = os.pwrite(dst, os.pread(src, min(_CHUNK, end - start), start), start)
            if done <= 0:  # shrunk meanwhile
                break
            start += done
        offset = max(end, offset + 1)
    os.ftruncate(dst, size)


def _copy_attributes(src: int, dst: int, info: os.stat_result) -> None:
    """Extended attributes, owner, then mode (a chown clears set-id bits), then times."""
    for attribute in os.listxattr(src):
        _copy_xattr(attribute, os.getxattr(src, attribute), lambda a, v: os.setxattr(dst, a, v))
    os.fchown(dst, info.st_uid, info.st_gid)
    os.fchmod(dst, stat.S_IMODE(info.st_mode))
    os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns))


def _copy_xattrs_by_name(src_dir: int, dst_dir: int, name: str) -> None:
    """Extended attributes of a symlink or special file (no descriptor to read them by)."""
    source, target = f"/proc/self/fd/{src_dir}/{name}", f"/proc/self/fd/{dst_dir}/{name}"
    try:
        attributes = os.listxattr(source, follow_symlinks=False)
    except OSError:
        return
    for attribute in attributes:
        try:
            value = os.getxattr(source, attribute, follow_symlinks=False)
        except OSError:
            continue
        _copy_xattr(attribute, value, lambda a, v: os.setxattr(target, a, v, follow_symlinks=False))


def _copy_xattr(attribute: str, value: bytes, set_it) -> None:
    try:
        set_it(attribute, value)
    except OSError as exc:
        if attribute.startswith("trusted.overlay."):  # the layer's meaning (opaque directories): never dropped
            raise
        log.debug("not copying extended attribute %s: %s", attribute, exc)
