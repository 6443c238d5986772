"""`orchard sandbox shell`: a terminal in a sandbox from the CLI, exit code back (stdin piped
here; raw mode and window size apply when stdin is a terminal)."""

from __future__ import annotations

import subprocess
import sys


def test_shell_runs_in_the_sandbox_and_returns_its_exit_code(orchard_client):
    with orchard_client.create("host") as sandbox:
        result = subprocess.run([sys.executable, "-m", "orchard.cli", "sandbox", "shell", sandbox.id],
                                input=b"echo hi-from-$((6*7))\nexit 7\n", capture_output=True, timeout=60)
        assert b"hi-from-42" in result.stdout, result.stderr
        assert result.returncode == 7
