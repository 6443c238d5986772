"""Plugins inside the agent process: image policy and sandbox events, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from orchard.errors import ImageRejected

PLUGIN = textwrap.dedent("""
    import json, os
    from orchard import hookimpl

    @hookimpl
    def orchard_verify_image(image, policy):
        return "registry not allowed" if image.startswith("docker://forbidden.example") else None

    @hookimpl
    def orchard_sandbox_event(event):
        with open(os.environ["ORCHARD_TEST_EVENT_LOG"], "a") as log:
            log.write(json.dumps(event) + "\\n")
""")


@pytest.fixture
def agent_with_plugin(tmp_path, monkeypatch):
    plugin_dir = tmp_path / "site"
    dist = plugin_dir / "orchard_event_probe-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: orchard-event-probe\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[orchard]\nprobe = orchard_event_probe\n")
    (plugin_dir / "orchard_event_probe.py").write_text(PLUGIN)
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(plugin_dir))
    monkeypatch.setenv("ORCHARD_TEST_EVENT_LOG", str(events))
    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import stop_agent
    from orchard.client import Client

    settings = AgentSettings(state_dir=Path(f"/tmp/orchard-plugin-{os.getpid()}"))
    client = Client(backend_settings={"agent": settings.model_dump(mode="json")})
    yield client, events
    client.close()
    stop_agent(settings)
    subprocess.run(["rm", "-rf", str(settings.state_dir)])


def test_image_policy_and_events_run_inside_the_agent(agent_with_plugin):
    client, events = agent_with_plugin
    with pytest.raises(ImageRejected, match="registry not allowed"):
        client.create("docker://forbidden.example/evil:latest")
    with client.create() as sandbox:
        sandbox.exec("true")
        sandbox_id = sandbox.id
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    mine = [e["type"] for e in seen if e["sandbox_id"] == sandbox_id]
    assert mine == ["ready", "deleted"]
    assert all(isinstance(e["time"], float) for e in seen)


def test_agent_leaves_no_zombies(orchard_client, agent_settings):
    with orchard_client.create() as sandbox:
        for _ in range(5):
            sandbox.exec("(sleep 0.05 &) ; sleep 0.1 & true")
        sandbox.exec("sleep 0.3")
    agent_pid = json.loads((agent_settings.agent_dir / "agent.json").read_text())["pid"]
    zombies = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == agent_pid:
                zombies.append(entry.name)
    assert zombies == []
