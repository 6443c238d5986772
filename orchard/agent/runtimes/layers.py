"""Per-sandbox writable layers over shared, read-only image roots (root agents only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

from orchard.agent import inroot
from orchard.agent.host_ids import idmapped_views
from orchard.agent.images import ResolvedImage
from orchard.agent.runtimes.mounts import mount
from orchard.agent.sandbox import Placement, SandboxState
from orchard.errors import ImageRejected, RuntimeUnavailable


def writable_root(sandbox: SandboxState, image: ResolvedImage, disk: Optional[int],
                  owner: Optional[tuple[int, int]], placement: Placement,
                  image_owner: Optional[tuple[int, int]] = None, base: Sequence[Path] = ()) -> Path:
    """An overlayfs of the image under a fresh upper layer (on a tmpfs of ``disk`` bytes
    when given), owned by ``owner``; its mounts are recorded in ``placement`` for stop.
    An image unpacked for ``image_owner`` is shown to the sandbox as its own, and so are
    ``base``, the frozen layers of the snapshot a fork starts from (newest first)."""
    if owner is None:
        raise RuntimeUnavailable("root-filesystem images need a root agent (for the overlayfs writable layer)")
    assert image.rootfs is not None
    sandbox.state_dir.mkdir(mode=0o700)  # only images with a writable layer need one
    os.chown(sandbox.state_dir, *owner)
    placement.layer = sandbox.state_dir / "layer"
    try:
        return overlay_root(image.rootfs, sandbox.state_dir, owner, disk, placement.mounts, image_owner, base)
    except OSError as exc:
        raise ImageRejected(f"cannot build the writable layer of {image.reference}: {exc}") from None


MOUNT_OPTIONS_MAX = 4095  # mount(2) copies one page of options, its last byte a NUL
LONGEST_SANDBOX_ID = 63  # models.SANDBOX_ID_PATTERN


def overlay_options(directory: Path, lowers: Sequence[Path]) -> str:
    """The overlay's mount options for a sandbox whose files live in ``directory``."""
    layer = directory / "layer"
    return f"lowerdir={':'.join(map(str, lowers))},upperdir={layer / 'upper'},workdir={layer / 'work'}"


def view_paths(directory: Path, layers: int) -> list[Path]:
    """Where a sandbox in ``directory`` sees its ``layers`` snapshot layers (``l0`` the
    newest) and its image (``i``) through idmapped mounts: short names, so the overlay's
    options fit in a page with many layers."""
    return [directory / f"l{n}" for n in range(layers)] + [directory / "i"]


def fork_options_length(sandboxes_dir: Path, layers: int) -> int:
    """The length of the overlay options of a sandbox with ``layers`` snapshot layers and
    the longest id (the worst case a snapshot must leave room for)."""
    directory = sandboxes_dir / ("x" * LONGEST_SANDBOX_ID)
    return len(overlay_options(directory, view_paths(directory, layers)))


def layer_inodes(disk: int) -> int:
    """Files a writable layer of ``disk`` bytes may hold: one a page, at least 1,024. A
    tmpfs's size= counts data pages only; each inode pins about a KiB of kernel memory
    beside them, so an unbounded count let a small quota pin gigabytes in empty files."""
    return max(disk // 4096, 1024)


def overlay_root(lower: Path, directory: Path, owner: tuple[int, int], disk: Optional[int],
                 mounts: list[Path], lower_owner: Optional[tuple[int, int]] = None,
                 base: Sequence[Path] = ()) -> Path:
    """Mount ``directory/root``: an overlay of ``base`` (frozen snapshot layers, newest
    first) over ``lower`` whose upper layer lives in ``directory/layer`` (a tmpfs of
    ``disk`` bytes when given), owned by ``owner``. When the lower layers belong to
    ``lower_owner``, another id, the overlay sees them through idmapped mounts
    (``view_paths``) that show them owned by ``owner``. Each mount is put at the front of
    ``mounts`` as it is made (every view: a bind on the same filesystem is no mount point
    to ``os.path.ismount``; unmounting one never made is harmless), so a failure part-way
    still leaves the caller the list to undo."""
    layer, root = directory / "layer", directory / "root"
    layer.mkdir()
    root.mkdir()
    lowers = [*base, lower]
    if lower_owner is not None and lower_owner != owner:
        views = view_paths(directory, len(base))
        for view in views:
            view.mkdir()
        try:
            idmapped_views(list(zip(lowers, views)), lower_owner, owner)
        finally:
            mounts[:0] = list(reversed(views))
        lowers = views
    options = overlay_options(directory, lowers)
    if len(options) > MOUNT_OPTIONS_MAX:
        raise OSError(f"the overlay's mount options take {len(options)} bytes, more than a page: too many "
                      "snapshot layers for this state_dir")
    if disk:
        mount("tmpfs", layer, "tmpfs", f"size={disk},nr_inodes={layer_inodes(disk)},mode=0700,uid={owner[0]},gid={owner[1]}")
        mounts.insert(0, layer)
    for sub in ("upper", "work"):
        (layer / sub).mkdir()
        os.chown(layer / sub, *owner)
    mount("overlay", root, "overlay", options)
    mounts.insert(0, root)
    os.chown(root, *owner)
    return root


def ensure_paths(root: Path, directories: Iterable[str], files: Iterable[str]) -> None:
    """Create what a container tool binds onto and an image lacks, in a writable root (a
    sandbox's own layer or our own unpacked copy, never a shared image). Resolved inside
    the root: an image's symlinks never steer these onto host paths."""
    try:
        for name in directories:
            inroot.make_dirs(str(root), name)
        for name in files:
            inroot.make_file(str(root), name)
    except OSError as exc:  # e.g. a symlink to a directory the image lacks
        raise ImageRejected(f"cannot prepare the image's {exc.filename or 'tree'}: {exc.strerror}") from None


def image_workdir(image: ResolvedImage, root: Path) -> str:
    """The image's WORKDIR, else /workspace when the image has one, else /."""
    workdir = image.workdir
    if not workdir or workdir == "/":
        workdir = "/workspace" if (root / "workspace").is_dir() else "/"
    return workdir
