"""Build (once) and locate ``orchard-enter``, the static helper every command goes through.

It is compiled from ``orchard_enter.c`` on first use and cached by the source's hash,
so upgrades rebuild it. An agent bundle carries a prebuilt one (images have no
compiler); ``ORCHARD_ENTER`` points at another prebuilt binary.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from orchard.errors import RuntimeUnavailable

SOURCE = Path(__file__).with_name("orchard_enter.c")
INCLUDED = ("enter_files.c", "enter_seccomp.c", "enter_spawner.c")  # #included by SOURCE
BUNDLE_MARKER = "orchard-bundle.json"


def bundle_root() -> Optional[Path]:
    """The agent bundle this interpreter belongs to (``DIR/python`` is its prefix), if any."""
    root = Path(sys.prefix).parent
    return root if (root / BUNDLE_MARKER).is_file() else None


def compile_static(source: Path, output: Path, *flags: str) -> None:
    """``cc -O2 -static -s``: a binary that runs in any image of this architecture."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeUnavailable(f"building {output.name} needs a C compiler (apt-get install gcc libc6-dev)")
    result = subprocess.run([compiler, "-O2", "-static", "-s", *flags, "-o", str(output), str(source)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeUnavailable(f"building {output.name} failed (needs static libc: libc6-dev):\n{result.stderr}")
    os.chmod(output, 0o755)


def source_digest() -> str:
    """Hash of the helper's sources, so any change rebuilds it."""
    sha = hashlib.sha256(SOURCE.read_bytes())
    for name in INCLUDED:
        sha.update(SOURCE.with_name(name).read_bytes())
    return sha.hexdigest()[:12]


def helper_path(cache_dir: Path) -> Path:
    """Path of a usable static ``orchard-enter``, building it into ``cache_dir`` if needed."""
    override = os.environ.get("ORCHARD_ENTER")
    if override:
        return Path(override)
    bundle = bundle_root()
    if bundle is not None:
        return bundle / "bin" / "orchard-enter"
    digest = source_digest()
    target = cache_dir / f"orchard-enter-{digest}"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(cache_dir, 0o755)  # the holder binary is bound into sandboxes by an unprivileged bwrap
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        built = Path(tmp) / "orchard-enter"
        compile_static(SOURCE, built)
        os.replace(built, target)
    return target
