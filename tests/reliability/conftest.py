"""Fixtures of the reliability tests: a real `orchard serve` (tests/server/conftest.py), and
the `slow` marker: long variants run only when asked for (`pytest -m slow tests/reliability`)."""

from __future__ import annotations

import pytest

from tests.server.conftest import server_factory

__all__ = ["server_factory"]  # a fixture, used by name


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="long variant: run with -m slow")
    for item in items:
        if "slow" in item.keywords and "tests/reliability" in str(item.fspath):
            item.add_marker(skip)
