"""Can the sandbox uid reach a directory? Sandbox roots, the helper and the ``host``
image's /etc are bound into sandboxes by tools running as that uid, so every directory
above them must let it pass; a private parent (``mktemp -d``, a 0700 home or scratch
directory) otherwise fails every create deep inside bubblewrap."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional


def blocking_ancestor(path: Path, uid: int, gid: int) -> Optional[Path]:
    """The first directory from / down to ``path`` that ``uid``/``gid`` cannot traverse."""
    current = Path("/")
    for part in Path(os.path.abspath(path)).parts[1:]:
        current = current / part
        try:
            info = current.stat()
        except FileNotFoundError:
            return None  # made later, by us, with modes we choose
        if not stat.S_ISDIR(info.st_mode):
            return None
        mode = info.st_mode
        if info.st_uid == uid:
            allowed = mode & stat.S_IXUSR
        elif info.st_gid == gid:
            allowed = mode & stat.S_IXGRP
        else:
            allowed = mode & stat.S_IXOTH
        if not allowed:
            return current
    return None


def unreachable_reason(path: Path, uid: int, gid: int, setting: str) -> Optional[str]:
    """A message a person can act on, or None when ``uid`` can reach ``path``."""
    blocked = blocking_ancestor(path, uid, gid)
    if blocked is None:
        return None
    mode = stat.S_IMODE(blocked.stat().st_mode)
    return (f"{setting} {path} lies below {blocked} (mode {mode:04o}), which the unprivileged sandbox uid {uid} "
            f"cannot pass through; run `chmod o+x {blocked}` or choose a {setting} under a directory others may "
            "traverse")
