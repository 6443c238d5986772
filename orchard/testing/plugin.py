"""Pytest plugin (entry point ``pytest11: orchard``): options and fixtures of the kit.

``--orchard-backend NAME`` (repeatable) chooses the backends the conformance tests
run against (default: the test module's ``orchard_backends`` list, else local); given with no
test paths, it runs the whole suite: ``pytest -p orchard.testing --orchard-backend NAME``;
``--orchard-backend-config FILE`` is a YAML or JSON mapping ``{backend name: settings}``
validated by each backend's own config model.
A project's conftest may instead override the ``orchard_backend_settings`` fixture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

SUITE = Path(__file__).with_name("conformance.py")  # imports isolation, hostile and snapshots


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("orchard", "Orchard backend conformance")
    group.addoption("--orchard-backend", action="append", default=[], metavar="NAME",
                    help="backend to run the conformance tests against (repeatable; default: local)")
    group.addoption("--orchard-backend-config", default=None, metavar="FILE",
                    help="YAML/JSON file: {backend name: settings}")
    group.addoption("--orchard-image", default="host", metavar="IMAGE",
                    help="image of the kit's sandboxes: 'host' (default), a directory or docker:// reference with "
                         "a shell, coreutils, python3 and git (orchard.testing.images builds one)")
    group.addoption("--orchard-unsupported", action="append", default=[], metavar="LIMIT",
                    help="a limit the backend declares it cannot enforce (memory, pids, cpu, disk): the kit then "
                         "checks that asking for it is refused with an error naming it (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    """One command proves a backend: with ``--orchard-backend`` and no test paths on the
    command line, the session collects the whole conformance suite (no test module to write)."""
    if config.getoption("--orchard-backend") and config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = [str(SUITE)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "orchard_backend_name" in metafunc.fixturenames:
        names = (metafunc.config.getoption("--orchard-backend") or getattr(metafunc.module, "orchard_backends", None)
                 or ["local"])
        metafunc.parametrize("orchard_backend_name", names, scope="session")


@pytest.fixture(scope="session")
def orchard_backend_settings(pytestconfig: pytest.Config) -> dict[str, Any]:
    """Settings per backend name; override this fixture to compute them in code."""
    path = pytestconfig.getoption("--orchard-backend-config")
    if not path:
        return {}
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        return yaml.safe_load(text) or {}
    return json.loads(text)


@pytest.fixture(scope="session")
def orchard_client(orchard_backend_name: str, orchard_backend_settings: dict[str, Any]) -> Iterator[Any]:
    """A sync client on the backend under test, in process."""
    from orchard.client import Client

    client = Client(backend=orchard_backend_name, backend_settings=orchard_backend_settings.get(orchard_backend_name))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def orchard_image(pytestconfig: pytest.Config) -> str:
    """The image the kit's sandboxes run; override this fixture to build one in code."""
    return pytestconfig.getoption("--orchard-image")


@pytest.fixture(scope="session")
def orchard_unsupported(pytestconfig: pytest.Config) -> frozenset[str]:
    """Limits the backend under test declares it cannot enforce (it must refuse them by name)."""
    return frozenset(pytestconfig.getoption("--orchard-unsupported"))


@pytest.fixture
def sandbox(orchard_client: Any, orchard_image: str) -> Iterator[Any]:
    """A fresh sandbox (the kit's image, network blocked), deleted after the test."""
    with orchard_client.create(orchard_image) as handle:
        yield handle
