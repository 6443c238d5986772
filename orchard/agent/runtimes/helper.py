"""Build (once) and locate ``orchard-enter``, the static helper every command goes through.

It is compiled from ``orchard_enter.c`` on first use and cached by the source's hash,
so upgrades rebuild it. ``ORCHARD_ENTER`` points at a prebuilt binary instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from orchard.errors import RuntimeUnavailable

SOURCE = Path(__file__).with_name("orchard_enter.c")


def helper_path(cache_dir: Path) -> Path:
    """Path of a usable static ``orchard-enter``, building it into ``cache_dir`` if needed."""
    override = os.environ.get("ORCHARD_ENTER")
    if override:
        return Path(override)
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    target = cache_dir / f"orchard-enter-{digest}"
    if target.exists():
        return target
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeUnavailable(
            "building orchard-enter needs a C compiler once (apt-get install gcc libc6-dev), "
            "or set ORCHARD_ENTER to a prebuilt static binary"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(cache_dir, 0o755)  # the holder binary is bound into sandboxes by an unprivileged bwrap
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        built = Path(tmp) / "orchard-enter"
        result = subprocess.run(
            [compiler, "-O2", "-static", "-o", str(built), str(SOURCE)],
            capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise RuntimeUnavailable(f"building orchard-enter failed (needs static libc: libc6-dev):\n{result.stderr}")
        os.chmod(built, 0o755)
        os.replace(built, target)
    return target
