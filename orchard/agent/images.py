"""Images: ``host``, a root-filesystem directory, or a ``docker://`` reference.

``docker://`` images are pulled with skopeo and unpacked with umoci into a cache
keyed by manifest digest, so each image is pulled once; the image config (Env,
WorkingDir) is honoured. Unpacked trees belong to the unprivileged sandbox uid, so
a sandbox owns its image's files the way a rootless container does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from orchard.agent.image_policy import registry_of, repository
from orchard.agent.image_trust import ImageTrust
from orchard.agent.reaper import ChildReaper, run_tool
from orchard.agent.runtimes.mounts import system_binds
from orchard.errors import ImageRejected, RuntimeUnavailable
from orchard.plugins import verify_image

HOST_IMAGE = "host"
REFERENCE_TTL = 300.0


@dataclass
class ResolvedImage:
    reference: str
    kind: Literal["host", "rootfs"]
    rootfs: Optional[Path] = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: Optional[str] = None
    digest: Optional[str] = None




def pinned(reference: str, digest: str) -> str:
    """``docker://REPO@DIGEST`` for ``docker://REPO[:TAG][@DIGEST]``: what was inspected is what
    gets pulled, even if the tag moves in between (the cache is keyed by the inspected digest)."""
    return f"docker://{repository(reference)}@{digest}"


def _last_line(text: str) -> str:
    """A tool's last word: skopeo's ``time=... level=fatal msg="..."`` reduced to its message."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    found = LOGRUS_MESSAGE.search(lines[-1])
    return found.group(1).replace('\\"', '"') if found else lines[-1]


LOGRUS_MESSAGE = re.compile(r'msg="((?:[^"\\]|\\.)*)"')


class ImageStore:
    def __init__(self, cache_dir: Path, owner: Optional[tuple[int, int]], policy: dict[str, Any],
                 reaper: ChildReaper) -> None:
        self.cache_dir = cache_dir
        cache_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        self.reaper = reaper
        self.owner = owner
        self.policy = policy  # for the orchard_verify_image hooks (AgentSettings.image_policy)
        self.insecure_registries = list(policy.get("insecure_registries", []))
        self.trust = ImageTrust(policy)  # skopeo's trust options; cache keys that keep checked images apart
        self._digests: dict[str, tuple[str, float]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def _run(self, *argv: str, uid: Optional[int] = None, home: Optional[Path] = None) -> tuple[int, str, str]:
        """Run a tool (as ``uid`` when given) and collect its output."""
        if uid is not None:
            argv = ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv)
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
        if home is not None:
            env.update(HOME=str(home), TMPDIR=str(home))
        return await run_tool(self.reaper, list(argv), env)

    async def resolve(self, image: str) -> ResolvedImage:
        reason = verify_image(image, self.policy)
        if reason:
            raise ImageRejected(f"image {image!r} refused by policy: {reason}")
        if image == HOST_IMAGE:
            return ResolvedImage(reference=image, kind="host")
        if image.startswith("docker://"):
            return await self._pull(image)
        path = Path(image.removeprefix("dir://"))
        if not path.is_absolute():
            raise ImageRejected(f"image {image!r}: use 'host', an absolute root-filesystem directory, or docker://REF")
        if not path.is_dir():
            raise ImageRejected(f"image {image!r}: directory does not exist")
        return await self._import_directory(image, path)

    async def _import_directory(self, image: str, path: Path) -> ResolvedImage:
        """Copy a root-filesystem directory into the cache once, owned by the sandbox uid,
        as a rootless unpack would (the directory itself is never touched)."""
        info = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{info.st_ino}:{info.st_mtime_ns}".encode()).hexdigest()[:24]
        target = self.cache_dir / f"dir-{key}"
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if not (target / "rootfs").is_dir():
                staging = self.cache_dir / f".import-{key}-{os.getpid()}"
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir()
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
                (staging / "rootfs").mkdir()
                code, _, err = await self._copy_confined(path, staging / "rootfs", env)
                if code == 0 and self.owner is not None:
                    code, _, err = await run_tool(
                        self.reaper, ["chown", "-R", "-h", f"{self.owner[0]}:{self.owner[1]}", str(staging)], env)
                if code != 0:
                    shutil.rmtree(staging, ignore_errors=True)
                    raise ImageRejected(f"image {image!r} cannot be imported: {_last_line(err)}")
                os.replace(staging, target)
        return ResolvedImage(reference=image, kind="rootfs", rootfs=target / "rootfs")

    async def _copy_confined(self, source: Path, target: Path, env: dict[str, str]) -> tuple[int, str, str]:
        """``cp -a SOURCE/. TARGET`` inside a bubblewrap whose root holds only the system's
        /usr (for cp), the image at /src and the target at /dst: a symlink in the image, or
        one swapped in while the copy runs, resolves in that root, never to the host's
        /etc or /root, whatever cp follows. The image directory is opened once and judged
        by where that descriptor is, so swapping a path component after the check changes
        nothing."""
        try:
            pinned = os.open(source, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            return 1, "", f"{source}: {exc.strerror}"
        try:
            where = os.readlink(f"/proc/self/fd/{pinned}")
            reason = verify_image(where, self.policy)
            if reason:
                return 1, "", f"image directory {source} now resolves to {where}: {reason}"
            return await self._confined_cp(pinned, target, env)
        finally:
            os.close(pinned)

    async def _confined_cp(self, pinned: int, target: Path, env: dict[str, str]) -> tuple[int, str, str]:
        # Root without a user namespace, keeping only the right to read any file (images may
        # hold root-only files); ownership is not kept: the tree is chowned to its owner next.
        argv = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--die-with-parent",
                "--cap-add", "CAP_DAC_READ_SEARCH", "--tmpfs", "/", *system_binds(), "--ro-bind", "/proc/self/fd/3", "/src",
                "--bind", str(target), "/dst", "--", "cp", "-R", "-P", "--preserve=mode,timestamps,links",
                "/src/.", "/dst/"]
        code, out, err = await run_tool(self.reaper, argv, env, pass_fds={pinned: 3})
        problems = [line for line in err.splitlines() if line.strip() and "cannot create special file" not in line]
        return (0 if code == 1 and not problems else code), out, "\n".join(problems)  # device nodes are left out

    def _tls_flag(self, reference: str, option: str) -> list[str]:
        """TLS off for the allowed insecure registries only, read as skopeo reads the reference
        (``docker://localhost:5000`` is docker.io's ``library/localhost``, not localhost)."""
        host = registry_of(reference).rsplit(":", 1)[0]
        return [f"--{option}=false"] if host in self.insecure_registries else []

    async def _digest(self, reference: str) -> str:
        cached = self._digests.get(reference)
        if cached and time.monotonic() - cached[1] < REFERENCE_TTL:
            return cached[0]
        if shutil.which("skopeo") is None:
            raise RuntimeUnavailable("docker:// images need skopeo and umoci (apt-get install skopeo umoci)")
        code, out, err = await self._run("skopeo", "inspect", *self._tls_flag(reference, "tls-verify"), reference)
        if code != 0:
            raise ImageRejected(f"image {reference!r} cannot be pulled: {_last_line(err)}")
        digest = json.loads(out)["Digest"]
        self._digests[reference] = (digest, time.monotonic())
        return digest

    async def _pull(self, reference: str) -> ResolvedImage:
        digest = await self._digest(reference)
        target = self.cache_dir / self.trust.cache_name(digest, reference)
        lock = self._locks.setdefault(target.name, asyncio.Lock())
        async with lock:
            if not (target / "rootfs").is_dir():
                await self._unpack(reference, digest, target)
        config = json.loads((target / "config.json").read_text())
        process = config.get("process", {})
        env = dict(item.split("=", 1) for item in process.get("env", []) if "=" in item)
        return ResolvedImage(reference=reference, kind="rootfs", rootfs=target / "rootfs", env=env,
                             workdir=process.get("cwd") or None, digest=digest)

    async def _unpack(self, reference: str, digest: str, target: Path) -> None:
        staging = self.cache_dir / f".pull-{digest.replace(':', '-')}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        uid = None
        if self.owner is not None:
            os.chown(staging, *self.owner)
            uid = self.owner[0]
        try:
            # signatures are checked against the trust policy here; an OCI layout cannot store them
            code, _, err = await self._run("skopeo", *self.trust.options, "copy", "--quiet", "--remove-signatures",
                                           *self._tls_flag(reference, "src-tls-verify"), pinned(reference, digest),
                                           f"oci:{staging}/oci:image", uid=uid, home=staging)
            if code != 0:
                raise ImageRejected(f"image {reference!r} cannot be pulled: {_last_line(err)}")
            code, _, err = await self._run("umoci", "unpack", "--rootless", "--image", f"{staging}/oci:image",
                                      f"{staging}/bundle", uid=uid, home=staging)
            if code != 0:
                raise ImageRejected(f"image {reference!r} cannot be unpacked: {_last_line(err)}")
            try:
                os.replace(staging / "bundle", target)
            except OSError:
                if not (target / "rootfs").is_dir():  # else another process sharing the cache won the race
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
