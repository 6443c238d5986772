"""The launch dir: what the trainer trusts (the URL it sends the API key to, signed with the
key) and the files the server writes there (its config, its key). It must be this user's
alone: it is checked, and everything in it is opened relative to a descriptor of the checked
directory, never through a symlink, never blocking on a FIFO."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from pathlib import Path
from typing import Optional

from orchard.launch.recipe import Recipe


class LaunchError(Exception):
    """A launch that cannot start as configured (the CLI reports it as a usage error)."""


def url_mac(url: str, api_key: str) -> str:
    """What the server writes under its URL: only a holder of the launch's key can make it, so
    a URL file left by an earlier launch with another key (whose host and port may be someone
    else's by now) or written by anyone else is never taken for this launch's."""
    return hmac.new(api_key.encode(), b"orchard launch url\0" + url.encode(), hashlib.sha256).hexdigest()


def launch_api_key(api_key: Optional[str]) -> str:
    key = api_key if api_key is not None else os.environ.get("ORCHARD_API_KEY")
    if not key:
        raise LaunchError("set ORCHARD_API_KEY: the launch's server requires it, and the trainer checks the "
                          "server's URL file with it")
    return key


# The launch dir holds what the trainer trusts (the URL it sends the API key to) and files the
# server writes (its config and state): it must be ours alone. Everything in it is opened
# relative to a descriptor of the checked directory, never by following a symlink.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # a FIFO never blocks
_URL_MAX = 4096


def _trusted_owner(uid: int) -> bool:
    """Ours; or, for a trainer running as root, any user's (in k8s/launch/rayjob.yaml the server
    runs as 10001 beside a root slime container; only the pod's containers mount the volume)."""
    return uid == os.geteuid() or os.geteuid() == 0


def _check_private(st: os.stat_result, path: Path, kind: str, owner: Optional[int] = None) -> None:
    problem = None
    if not (stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)):
        problem = f"not a {kind}"
    elif not _trusted_owner(st.st_uid) or (owner is not None and st.st_uid != owner):
        problem = f"owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"writable by others (mode {oct(st.st_mode & 0o7777)})"
    if problem:
        raise LaunchError(f"{path}: {problem}; the launch refuses it, since whoever can write there could redirect "
                          "the trainer, and the API key with it (check its contents, then chmod 700 it or remove it)")


def open_launch_dir(recipe: Recipe, create: bool = False) -> int:
    """A descriptor of the launch dir once checked: a real directory (not a symlink) of this
    user that nobody else can write; made 0700 where ``create`` and absent.
    FileNotFoundError where absent and not ``create``."""
    path = recipe.launch_dir
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: something else
        raise LaunchError(f"{path}: not a directory of this user ({exc.strerror}); the launch refuses it") from None
    try:
        _check_private(os.fstat(fd), path, "directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_in(dir_fd: int, name: str, text: str, mode: int) -> None:
    part = name + ".part"
    try:
        os.unlink(part, dir_fd=dir_fd)  # a symlink is removed, not followed
    except FileNotFoundError:
        pass
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(fd, mode)  # the umask may have taken bits away; the descriptor, never a path
        handle.write(text)
    os.replace(part, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # replaces a symlink there, never follows it


def write_atomically(path: Path, text: str, mode: int = 0o644, dir_fd: Optional[int] = None) -> None:
    """Readers never see a half-written file (the trainer polls the URL file), and a file of
    mode 0600 is never readable by others, not even for a moment (it may hold the API key).
    No symlink is followed: neither at ``path`` nor at its ``.part``; ``dir_fd`` (a checked
    directory's descriptor) is where ``path.name`` is written when given."""
    if dir_fd is not None:
        return _write_in(dir_fd, path.name, text, mode)
    parent = os.open(path.parent, _DIR_FLAGS)
    try:
        _write_in(parent, path.name, text, mode)
    finally:
        os.close(parent)


def unlink_in(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def read_url(recipe: Recipe, api_key: Optional[str] = None) -> Optional[str]:
    """The URL in the launch dir's URL file, None while there is none or it is not this
    launch's (its ``mac`` line not made with the key). A launch dir or URL file that someone
    else could have written (a symlink, another user's, writable by others, not a regular
    file, e.g. a FIFO) is refused with LaunchError, as is a URL that is not http(s)."""
    key = launch_api_key(api_key)
    try:
        dir_fd = open_launch_dir(recipe)
    except FileNotFoundError:
        return None
    try:
        try:
            fd = os.open(recipe.url_file.name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symlink
            raise LaunchError(f"{recipe.url_file}: {exc.strerror}; the launch refuses it") from None
        try:
            _check_private(os.fstat(fd), recipe.url_file, "regular file", owner=os.fstat(dir_fd).st_uid)
            data = os.read(fd, _URL_MAX + 1)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    lines = data.decode("utf-8", "replace").strip().split("\n")
    url = lines[0].strip()
    if not url:
        return None  # being written (never, atomically) or emptied: look again
    if len(data) > _URL_MAX or not re.fullmatch(r"https?://[^\s/?#]+", url):
        raise LaunchError(f"{recipe.url_file}: not a server URL (http://host:port); the launch refuses it")
    mac = lines[1].strip() if len(lines) == 2 else ""
    if not hmac.compare_digest(mac.encode(), f"mac={url_mac(url, key)}".encode()):
        return None  # an earlier launch's (another key), or not the server's: wait for this launch's
    return url
