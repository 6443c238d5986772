"""Test fixtures: an isolated agent state directory shared by the whole session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Sandbox roots must be reachable by the unprivileged sandbox uid; pytest's tmp dirs are 0700.
TEST_STATE_DIR = Path(os.environ.get("ORCHARD_TEST_STATE_DIR", f"/tmp/orchard-test-{os.getpid()}"))


def pytest_configure(config: pytest.Config) -> None:
    os.environ["ORCHARD_STATE_DIR"] = str(TEST_STATE_DIR)


@pytest.fixture(scope="session")
def agent_settings():
    from orchard.agent.settings import AgentSettings

    # Directory images come from pytest's temporary directories; the registry is a real one on loopback.
    return AgentSettings(state_dir=TEST_STATE_DIR, image_dirs=["/tmp"], registries=["127.0.0.1", "localhost"])


@pytest.fixture(scope="session")
def kit_image():
    """A directory image with a shell, coreutils, python3 and git (built once, a few seconds):
    what generated tasks and snapshot tests run in."""
    from orchard.testing.images import build_kit_image

    parent = Path(f"/tmp/orchard-kit-{os.getpid()}")
    parent.mkdir(mode=0o755, exist_ok=True)
    yield str(build_kit_image(parent / "image"))
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="session")
def orchard_backend_settings(agent_settings):
    return {"local": {"agent": agent_settings.model_dump(mode="json")}}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import stop_agent

    stop_agent(AgentSettings(state_dir=TEST_STATE_DIR))
    shutil.rmtree(TEST_STATE_DIR, ignore_errors=True)
