"""A stream whose reader went away must not hold the agent.

Found when a probe's reader left mid-stream: with the connection gone uvicorn's ``send``
returns at once, so a stream that read on without waiting (a hole its command kept growing:
gigabytes of zeros that cost the command nothing) never let the loop run, the disconnect
was never seen, and the agent stopped answering every sandbox; a training run beside it
stalled for 15 minutes. A stream now skips holes and waits at least once per poll.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

READER = """
import json, sys
from orchard.client import Client
with Client(backend="local", backend_settings={"agent": json.loads(sys.argv[1])}) as client:
    sandbox = client.get(sys.argv[2])
    for event in sandbox.exec_stream("echo begun; sleep 0.3; truncate -s 1T /proc/self/fd/1; sleep 60"):
        if event.get("data") == "begun\\n":
            print("begun", flush=True)
"""


def test_a_stream_abandoned_by_its_reader_does_not_hold_the_agent(agent_settings):
    from orchard.backends.local.launcher import stop_agent
    from orchard.client import Client

    settings = agent_settings.model_copy(update={"state_dir": Path(f"{agent_settings.state_dir}-abandoned")})
    client = Client(backend="local", backend_settings={"agent": settings.model_dump(mode="json")})
    try:
        flooding, quiet = client.create("host"), client.create("host")
        reader = subprocess.Popen([sys.executable, "-c", READER, json.dumps(settings.model_dump(mode="json")),
                                   flooding.id], stdout=subprocess.PIPE, text=True)
        assert reader.stdout.readline() == "begun\n"  # the stream has begun ...
        time.sleep(1)
        reader.kill()  # ... and its reader goes away, as a killed trainer's does
        reader.wait()
        for _ in range(5):
            started = time.monotonic()
            assert quiet.exec("echo alive", timeout=10).stdout == "alive\n"
            assert time.monotonic() - started < 5, "the agent did not answer another sandbox"
            time.sleep(0.5)
        flooding.delete()
        quiet.delete()
    finally:
        client.close()
        stop_agent(settings, timeout=5)
        shutil.rmtree(settings.state_dir, ignore_errors=True)
