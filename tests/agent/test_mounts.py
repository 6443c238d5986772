"""Removing a sandbox's directory never deletes through a mount still below it."""

from __future__ import annotations

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
