"""``orchard bench bundle``: size of the agent bundle and the time from exec of its
launcher to an agent answering ``/health`` (target: <= 80 MB, <= 1 s)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from orchard.bench.measure import percentile
from orchard.bundle.build import build_bundle
from orchard.bundle.manifest import verify_bundle
from orchard.errors import AgentUnreachable

READY_LIMIT_SECONDS = 30.0


def _healthy(socket_path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(socket_path)
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: agent\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def time_to_ready(bundle: Path) -> float:
    """Seconds from exec of ``bin/orchard-agent`` to a 200 from ``/health``."""
    state = tempfile.mkdtemp(prefix="orchard-bench-bundle-")
    socket_path = os.path.join(state, "agent.sock")
    env = {"ORCHARD_AGENT_TOKEN": "bench"}  # the image's environment: nothing else
    start = time.perf_counter()
    process = subprocess.Popen([str(bundle / "bin" / "orchard-agent"), "--runtime", "direct", "--state-dir", state,
                                "--uds", socket_path], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not _healthy(socket_path):
            if process.poll() is not None:
                raise AgentUnreachable(f"the bundled agent exited: {process.stderr.read().decode()[-2000:]}")
            if time.perf_counter() - start > READY_LIMIT_SECONDS:
                raise AgentUnreachable(f"the bundled agent was not ready within {READY_LIMIT_SECONDS:.0f} s")
            time.sleep(0.002)
        return time.perf_counter() - start
    finally:
        process.terminate()
        process.wait()
        shutil.rmtree(state, ignore_errors=True)


def run_bundle_bench(bundle: Optional[Path], runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="orchard-bundle-") as scratch:
        started = time.perf_counter()
        if bundle is None:
            bundle = Path(scratch) / "bundle"
            manifest = build_bundle(bundle)
        else:
            manifest = verify_bundle(bundle)
        build_seconds = time.perf_counter() - started
        times = [time_to_ready(bundle) for _ in range(runs)]
    return {
        "bundle_mb": round(manifest["size"] / 1e6, 1),
        "files": len(manifest["files"]),
        "digest": manifest["digest"],
        "build_or_verify_seconds": round(build_seconds, 2),
        "ready_p50_seconds": round(percentile(times, 50), 3),
        "ready_max_seconds": round(max(times), 3),
        "runs": runs,
    }
