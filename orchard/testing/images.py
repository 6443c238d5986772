"""A small directory image with what the conformance kit needs (a shell, coreutils, python3,
git), built from this machine's Debian packages: runtimes that run images rather than the
``host`` view (Charliecloud, Podman, per-job containers) take the kit with it, and no
registry is needed. Built once per directory (about 150 MB, a few seconds)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

PACKAGES = ("bash", "dash", "coreutils", "python3-minimal", "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib",
            "git", "mawk", "sed", "grep", "findutils", "procps", "util-linux", "libc-bin")
SKIPPED = re.compile(r"^/usr/share/(doc|man|locale|info|lintian|bash-completion)/|/__pycache__/|/test/")
LIBRARY = re.compile(r"=>\s*(/\S+)|^\s*(/\S+)\s+\(")


def _package_files(package: str) -> list[str]:
    result = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the kit image needs the Debian package {package!r}: {result.stderr.strip()}")
    return [line for line in result.stdout.splitlines() if line.startswith("/") and not SKIPPED.search(line)]


def _libraries(files: list[Path]) -> set[str]:
    """The shared libraries the ELF files among ``files`` load (their ``ldd`` closure)."""
    found: set[str] = set()
    elf = [str(f) for f in files if f.is_file() and not f.is_symlink() and f.read_bytes()[:4] == b"\x7fELF"]
    for start in range(0, len(elf), 200):
        out = subprocess.run(["ldd", *elf[start:start + 200]], capture_output=True, text=True).stdout
        for line in out.splitlines():
            match = LIBRARY.search(line)
            if match:
                found.add(match.group(1) or match.group(2))
    return found


MERGED = ("bin", "sbin", "lib", "lib64")  # Debian 12 is merged-/usr: these are links into /usr


def _copy(source: str, root: Path) -> None:
    relative = source.lstrip("/")
    if relative.split("/", 1)[0] in MERGED:
        relative = "usr/" + relative
    target = root / relative
    if os.path.islink(source):
        target.parent.mkdir(parents=True, exist_ok=True)
        if not (target.exists() or target.is_symlink()):
            target.symlink_to(os.readlink(source))
        real = os.path.realpath(source)
        if real != source and os.path.exists(real):
            _copy(real, root)
    elif os.path.isdir(source):
        target.mkdir(parents=True, exist_ok=True)
    elif os.path.isfile(source) and not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def build_kit_image(root: Path) -> Path:
    """Build the image at ``root`` (a directory that is made; reused when it is complete)."""
    done = root / ".orchard-kit-image"
    if done.exists():
        return root
    staging = root.with_name(root.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in MERGED:
        (staging / "usr" / name).mkdir(parents=True)
        (staging / name).symlink_to(f"usr/{name}")
    files = sorted({path for package in PACKAGES for path in _package_files(package)})
    for path in files:
        _copy(path, staging)
    for library in sorted(_libraries([Path(p) for p in files])):
        _copy(library, staging)
    for name in ("root", "tmp", "home", "etc", "dev", "proc", "sys", "workspace"):
        (staging / name).mkdir(exist_ok=True)
    for name in ("tmp", "workspace"):
        (staging / name).chmod(0o1777)
    awk = staging / "usr" / "bin" / "awk"  # an alternatives link on the host
    if not awk.exists():
        awk.unlink(missing_ok=True)
        awk.symlink_to("mawk")
    (staging / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (staging / "etc" / "group").write_text("root:x:0:\n")
    (staging / ".orchard-kit-image").write_text("\n".join(PACKAGES) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    staging.rename(root)
    root.chmod(0o755)
    return root


def local_kit_image() -> Path:
    """The kit image, built once into the local agent's rootfs directory (where directory
    images are always allowed): benchmarks and the pipeline run in it by default."""
    from orchard.agent.settings import AgentSettings

    rootfs = AgentSettings().rootfs_dir
    rootfs.mkdir(parents=True, exist_ok=True)
    return build_kit_image(rootfs / "python-git")
