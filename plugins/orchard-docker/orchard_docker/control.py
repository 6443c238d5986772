"""A sandbox's control directory on the host: how the host reaches the agent in a container
that has no network, and how the agent gets its key without it showing in ``docker inspect``.

``STATE/sandboxes/<hash>/`` (the state directory is 0700, nothing in it is world-reachable):

- ``key`` (0600): the agent's key, the host's copy; never mounted.
- ``mounted-key`` (0444): the same key, bind-mounted read-only where the agent reads it at
  start; emptied (same inode, so the container sees it empty) once the agent answers, so the
  sandbox's own commands, which run as the agent's user, cannot read it afterwards.
- ``run/``: bind-mounted at /run/orchard, where the agent creates its Unix socket. Owned by
  an unprivileged uid and 0777 while the agent starts; 0555 once the socket exists, so the
  container's root, which has no capabilities and does not own it, can no longer write or
  chmod it (under a rootful engine with a root orchestrator; see the README otherwise).
- ``agent.sock``: a hard link to the agent's socket, made before any command ran. The host
  connects here, a path the sandbox cannot reach, so a socket or symlink the sandbox plants
  later in ``run/`` is never followed by the host.
- ``sandbox``: the sandbox id, written once its container exists (a directory without it is a
  creation in progress, or one that crashed, never a lost sandbox).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from orchard.errors import BackendUnavailable

UNPRIVILEGED_OWNER = 65534  # nobody: not the container's root, so it cannot chmod run/ back


@dataclass(frozen=True)
class ControlDir:
    """The paths of one sandbox's control directory."""

    path: Path

    @property
    def key(self) -> Path:
        return self.path / "key"

    @property
    def mounted_key(self) -> Path:
        return self.path / "mounted-key"

    @property
    def run(self) -> Path:
        return self.path / "run"

    @property
    def container_socket(self) -> Path:
        """The socket as the agent made it, in the directory the container shares."""
        return self.run / "agent.sock"

    @property
    def socket(self) -> Path:
        """The host's own link to the agent's socket (what callers connect to)."""
        return self.path / "agent.sock"

    @property
    def marker(self) -> Path:
        return self.path / "sandbox"

    def token(self) -> Optional[str]:
        try:
            return self.key.read_text().strip() or None
        except OSError:
            return None

    def sandbox_id(self) -> Optional[str]:
        try:
            return self.marker.read_text().strip() or None
        except OSError:
            return None


def sandboxes_dir(state_dir: Path) -> Path:
    return state_dir / "sandboxes"


def control_dir(state_dir: Path, sandbox_id: str) -> ControlDir:
    """Short, fixed-length names keep socket paths under the 108-byte limit for any id."""
    return ControlDir(sandboxes_dir(state_dir) / hashlib.sha256(sandbox_id.encode()).hexdigest()[:16])


def prepare_state_dir(state_dir: Path) -> None:
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    sandboxes_dir(state_dir).mkdir(mode=0o700, exist_ok=True)


def make(state_dir: Path, sandbox_id: str) -> tuple[ControlDir, str]:
    """A fresh control directory with a new key; (its paths, the key)."""
    prepare_state_dir(state_dir)
    control = control_dir(state_dir, sandbox_id)
    if control.path.exists():  # a crashed creation's leftovers (a live sandbox was found before this)
        remove(control)
    control.path.mkdir(mode=0o700)
    token = secrets.token_urlsafe(32)
    _write(control.key, token, 0o600)
    _write(control.mounted_key, token, 0o444)  # the container's user may be any uid
    control.run.mkdir()
    os.chmod(control.run, 0o777)  # the agent binds its socket here (any container uid)
    if os.geteuid() == 0:
        os.chown(control.run, UNPRIVILEGED_OWNER, UNPRIVILEGED_OWNER)
    return control, token


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, mode)


def seal(control: ControlDir, sandbox_id: str) -> None:
    """The agent answered: link its socket where only the host looks, close ``run/`` to the
    container, and empty the key the container was given. Nothing from the sandbox has run
    yet, so the socket is the agent's."""
    info = os.lstat(control.container_socket)
    if not stat.S_ISSOCK(info.st_mode):
        raise BackendUnavailable(f"sandbox {sandbox_id!r}: {control.container_socket} is not the agent's socket")
    os.link(control.container_socket, control.socket, follow_symlinks=False)
    os.chmod(control.run, 0o555)
    fd = os.open(control.mounted_key, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
    os.close(fd)


def mark(control: ControlDir, sandbox_id: str) -> None:
    """Its container exists now: from here on a missing container means a lost sandbox."""
    control.marker.write_text(sandbox_id)


def remove(control: ControlDir) -> None:
    """Everything, including what the container left in ``run/`` (symlinks are not followed)."""
    if control.run.exists() and os.geteuid() != 0:
        os.chmod(control.run, 0o700)  # ours: make its entries removable again
    shutil.rmtree(control.path, ignore_errors=True)


def existing(state_dir: Path) -> Iterator[ControlDir]:
    """Control directories whose container was made (they name their sandbox)."""
    try:
        entries = list(os.scandir(sandboxes_dir(state_dir)))
    except FileNotFoundError:
        return
    for entry in entries:
        control = ControlDir(Path(entry.path))
        if entry.is_dir(follow_symlinks=False) and control.marker.exists():
            yield control
