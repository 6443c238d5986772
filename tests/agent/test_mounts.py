"""Removing a sandbox's directory never deletes through a mount still below it."""

from __future__ import annotations

import os
import subprocess

from orchard.agent.runtimes.mounts import mount, mounts_below, remove_tree


def test_remove_tree_detaches_mounts_instead_of_deleting_through_them(tmp_path):
    shared = tmp_path / "image-cache"  # stands for the shared image an idmapped view shows
    shared.mkdir()
    (shared / "precious").write_text("every sandbox needs me")
    sandbox = tmp_path / "sandbox dir"  # a space: mountinfo escapes it
    (sandbox / "image").mkdir(parents=True)
    (sandbox / "layer").mkdir()
    subprocess.run(["mount", "-n", "--bind", str(shared), str(sandbox / "image")], check=True)
    mount("tmpfs", sandbox / "layer", "tmpfs", "size=1m")
    assert {p.name for p in mounts_below(sandbox)} == {"image", "layer"}
    assert remove_tree(sandbox)
    assert not sandbox.exists()
    assert (shared / "precious").read_text() == "every sandbox needs me"
    assert mounts_below(tmp_path) == []


def test_remove_tree_takes_trees_deeper_than_the_stack_and_longer_than_path_max(tmp_path):
    """Hostile code writes such trees (a sandbox with no disk quota writes on the host's
    disk): shutil.rmtree recursed once per level and raised RecursionError."""
    top = tmp_path / "deep"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(3000):  # 3000 x 101 characters: far past PATH_MAX
        name = f"{level % 10}" * 100
        os.mkdir(name, dir_fd=fd)
        if level % 500 == 0:
            os.close(os.open("file", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
            os.symlink("/", "link", dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    try:
        assert remove_tree(top)
        assert not top.exists()
        assert list(tmp_path.iterdir()) == []
    finally:  # what a failed removal left would break pytest's own clean-up (shutil.rmtree) later
        subprocess.run(["rm", "-rf", str(top)], check=False)
