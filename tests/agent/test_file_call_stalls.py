"""A sandbox that stops its own file-call helpers (they run as its user, in its PID
namespace) holds only its share of the agent's file-call slots, and only for a moment.

Before, with max_file_calls 16, one sandbox stopped the helpers of 16 of its own calls and
another sandbox's download waited for over 15 s (for good, had the test not ended).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from orchard.agent.settings import AgentSettings
from orchard.client import Client
from orchard.errors import FileOperationFailed, OrchardError

STOPPER = """nohup python3 -c '
import os, signal
while True:
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and int(pid) != os.getpid() and b"/orchard-enter" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")[0]:
                os.kill(int(pid), signal.SIGSTOP)
        except OSError:
            pass
' >/dev/null 2>&1 &"""


@pytest.fixture
def small_pool_agent(kit_image):
    from orchard.backends.local.launcher import stop_agent

    settings = AgentSettings(state_dir=Path(kit_image).parent / f"agent-file-stalls-{time.monotonic_ns()}",
                             image_dirs=["/tmp"], max_file_calls=8)
    client = Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")})
    # the hostile sandbox's calls without the SDK's retries: a download cut mid-stream is tried again
    once = Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")}, retries=0)
    yield client, once
    once.close()
    client.close()
    stop_agent(settings)


def test_stopped_helpers_are_killed_and_the_neighbour_is_served(small_pool_agent):
    client, once = small_pool_agent
    with client.create() as hostile, client.create() as neighbour:
        hostile.exec("head -c 16000000 /dev/urandom > /tmp/big", check=True)
        neighbour.exec("echo mine > /tmp/small", check=True)
        hostile.exec(STOPPER)
        time.sleep(0.5)
        with ThreadPoolExecutor(8) as pool:
            hostile_once = once.get(hostile.id)
            calls = [pool.submit(hostile_once.download, "/tmp/big") for _ in range(8)]
            time.sleep(1.0)
            started = time.monotonic()
            assert neighbour.download("/tmp/small") == b"mine\n"
            assert time.monotonic() - started < 5, "the neighbour waited for the hostile sandbox's stopped calls"
            finished, pending = wait(calls, timeout=60)
        assert not pending, "a file call of the hostile sandbox never ended"
        failures = [call.exception() for call in finished if call.exception() is not None]
        assert any(isinstance(f, FileOperationFailed) and "stopped" in str(f) for f in failures), failures
        assert all(isinstance(f, OrchardError) for f in failures), failures  # typed: refused, or cut mid-stream
