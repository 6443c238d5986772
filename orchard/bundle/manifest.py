"""The bundle's manifest: what it was built from, and every file's size, mode and sha256.

``digest`` covers the file list (not the inputs' source paths), so two bundles with
equal digests hold the same bytes; ``verify_bundle`` checks a copy (say, one an init
container made) against its manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from orchard.agent.runtimes.helper import BUNDLE_MARKER
from orchard.errors import InvalidRequest

FORMAT = 1
CHECKSUMS = "SHA256SUMS"  # the same hashes for `sha256sum -c` (coreutils or busybox), where no Python runs


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_table(root: Path) -> dict[str, dict[str, Any]]:
    table = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.is_symlink() or not path.is_file() or relative in (BUNDLE_MARKER, CHECKSUMS):
            continue
        table[relative] = {"size": path.stat().st_size, "mode": oct(path.stat().st_mode & 0o777),
                           "sha256": _sha256(path)}
    return table


def _digest(files: dict[str, dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(root: Path, inputs: dict[str, Any]) -> dict[str, Any]:
    files = file_table(root)
    manifest = {"format": FORMAT, "digest": _digest(files), "size": sum(f["size"] for f in files.values()),
                "inputs": inputs, "files": files}
    (root / CHECKSUMS).write_text("".join(f"{entry['sha256']}  {name}\n" for name, entry in files.items()))
    (root / BUNDLE_MARKER).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.chmod(root / CHECKSUMS, 0o644)
    os.chmod(root / BUNDLE_MARKER, 0o644)
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    try:
        return json.loads((root / BUNDLE_MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{root} is not an agent bundle: {exc}") from None


def verify_bundle(root: Path) -> dict[str, Any]:
    """The manifest, if every file is there with its recorded size, mode and hash."""
    manifest = read_manifest(root)
    actual = file_table(root)
    expected = manifest["files"]
    problems = [f"missing: {name}" for name in sorted(set(expected) - set(actual))]
    problems += [f"unexpected: {name}" for name in sorted(set(actual) - set(expected))]
    problems += [f"changed: {name}" for name in sorted(set(expected) & set(actual)) if expected[name] != actual[name]]
    if problems:
        raise InvalidRequest(f"bundle {root} does not match its manifest: " + "; ".join(problems[:10]))
    return manifest
