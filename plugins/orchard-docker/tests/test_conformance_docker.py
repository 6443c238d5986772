"""The plugin proves itself with Orchard's conformance kit, one command, against Podman's
Docker-compatible API: the whole suite, with the one limit this engine cannot enforce
(disk: overlay over ext4 has no per-container quota) declared and checked to be refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def test_conformance_suite_passes(docker_settings, kit_image, tmp_path):
    config = tmp_path / "backends.json"
    config.write_text(json.dumps({"docker": docker_settings}))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "orchard.testing",  # the whole suite
         "--orchard-backend", "docker", "--orchard-backend-config", str(config), "--orchard-image", kit_image,
         "--orchard-unsupported", "disk", "-rs"],
        capture_output=True, text=True, cwd=tmp_path, timeout=900)
    print(result.stdout.strip().splitlines()[-1])  # the kit's own summary, shown with -s
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
    assert int(re.search(r"(\d+) passed", result.stdout).group(1)) >= 28  # the whole suite ran, not a part
