"""Per-sandbox writable layers over shared, read-only image roots (root agents only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from orchard.agent.images import ResolvedImage
from orchard.agent.runtimes.mounts import mount
from orchard.agent.sandbox import Placement, SandboxState
from orchard.errors import ImageRejected, RuntimeUnavailable


def writable_root(sandbox: SandboxState, image: ResolvedImage, disk: Optional[int],
                  owner: Optional[tuple[int, int]], placement: Placement) -> Path:
    """An overlayfs of the image under a fresh upper layer (on a tmpfs of ``disk`` bytes
    when given), owned by ``owner``; its mounts are recorded in ``placement`` for stop."""
    if owner is None:
        raise RuntimeUnavailable("root-filesystem images need a root agent (for the overlayfs writable layer)")
    assert image.rootfs is not None
    sandbox.state_dir.mkdir(mode=0o700)  # only images with a writable layer need one
    os.chown(sandbox.state_dir, *owner)
    layer, root = sandbox.state_dir / "layer", sandbox.state_dir / "root"
    layer.mkdir()
    root.mkdir()
    try:
        if disk:
            mount("tmpfs", layer, "tmpfs", f"size={disk},mode=0700,uid={owner[0]},gid={owner[1]}")
            placement.mounts.insert(0, layer)
        for sub in ("upper", "work"):
            (layer / sub).mkdir()
            os.chown(layer / sub, *owner)
        mount("overlay", root, "overlay", f"lowerdir={image.rootfs},upperdir={layer / 'upper'},workdir={layer / 'work'}")
        placement.mounts.insert(0, root)
        os.chown(root, *owner)
    except OSError as exc:
        raise ImageRejected(f"cannot build the writable layer of {image.reference}: {exc}") from None
    return root


def image_workdir(image: ResolvedImage, root: Path) -> str:
    """The image's WORKDIR, else /workspace when the image has one, else /."""
    workdir = image.workdir
    if not workdir or workdir == "/":
        workdir = "/workspace" if (root / "workspace").is_dir() else "/"
    return workdir
