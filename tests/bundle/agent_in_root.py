"""Start the bundled agent inside a root filesystem with bubblewrap, the bundle mounted
read-only at /opt/orchard exactly as an init container's volume would be."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from pathlib import Path
from typing import Iterator, Optional

IMAGE_ENV = {  # what an image may set; the bundle must neither need nor disturb it
    "HOME": "/root",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONPATH": "/image/python",
    "LD_LIBRARY_PATH": "/image/lib",
}


@contextlib.contextmanager
def bundled_agent(root: Path, bundle: Path, state: Path, binds: Optional[dict[str, Path]] = None,
                  ready_timeout: float = 20.0) -> Iterator[tuple[str, str]]:
    """Yields (agent URL, token) for an agent started by ``/opt/orchard/bin/orchard-agent``."""
    token = secrets.token_urlsafe(16)
    state.mkdir(parents=True, exist_ok=True)
    argv = ["bwrap", "--ro-bind", str(root), "/", "--ro-bind", str(bundle), "/opt/orchard",
            "--bind", str(state), "/orchard-state", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--tmpfs", "/root"]
    for target, source in (binds or {}).items():
        argv += ["--bind", str(source), target]
    argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--clearenv"]
    for name, value in {**IMAGE_ENV, "ORCHARD_AGENT_TOKEN": token}.items():
        argv += ["--setenv", name, value]
    argv += ["/opt/orchard/bin/orchard-agent", "--runtime", "direct", "--state-dir", "/orchard-state",
             "--uds", "/orchard-state/agent.sock"]
    log = open(state / "agent.log", "wb")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    socket_path = state / "agent.sock"
    try:
        deadline = time.monotonic() + ready_timeout
        while not socket_path.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"bundled agent did not start:\n{(state / 'agent.log').read_text()[-3000:]}")
            time.sleep(0.02)
        yield f"unix://{socket_path}", token
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()

