"""Preparing an image's tree as root never follows the image's symlinks onto the host."""

from __future__ import annotations

import os

import pytest

from orchard.agent import inroot
from orchard.agent.runtimes.layers import ensure_paths
from orchard.errors import ImageRejected


def hostile_root(tmp_path):
    victim = tmp_path / "host-dir"  # stands for /etc, /opt, a user's home on the host
    victim.mkdir()
    root = tmp_path / "image"
    root.mkdir()
    (root / "root").symlink_to(victim)  # absolute: the image's /root -> a host path
    (root / "opt").symlink_to("../../../../../../" + str(victim).lstrip("/"))
    (root / "etc").mkdir()
    (root / "etc" / "hosts").symlink_to(victim / "hosts")
    return root, victim


def test_symlinks_to_host_paths_are_never_followed_out_of_the_root(tmp_path):
    root, victim = hostile_root(tmp_path)
    before = os.stat(victim)
    with pytest.raises(ImageRejected):  # inside the image, /root names a directory it lacks
        ensure_paths(root, ["root/orchard"], [])
    with pytest.raises(ImageRejected):
        ensure_paths(root, ["opt/orchard"], [])
    with pytest.raises(FileNotFoundError):
        inroot.chown(str(root), "/root", (123456, 123456))
    ensure_paths(root, ["dev"], ["etc/hosts"])  # an existing symlink is left alone, not written through
    assert list(victim.iterdir()) == [] and not (victim / "hosts").exists()
    after = os.stat(victim)
    assert (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)


def test_symlinks_resolve_to_the_images_own_paths(tmp_path):
    root, victim = hostile_root(tmp_path)
    inside = root / str(victim).lstrip("/")
    inside.mkdir(parents=True)  # the image has the directory its /root link names
    ensure_paths(root, ["root/orchard", "opt/orchard"], ["root/.bashrc"])
    inroot.chown(str(root), "/root", (123456, 123456))
    assert (inside / "orchard").is_dir() and (inside / ".bashrc").is_file()
    assert os.stat(inside).st_uid == 123456
    assert list(victim.iterdir()) == []
    assert inroot.exists_in_root(str(root), "/root/orchard", directory=True)
    assert not inroot.exists_in_root(str(root), f"/../../../{victim.name}")
