"""The test images' helpers themselves: names from random temporary directories are always valid."""

from __future__ import annotations

import re
import string

from tests.images import repository_name

COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|[-]*)[a-z0-9]+)*$")  # the OCI distribution grammar


def test_repository_names_are_always_valid():
    for text in ("perjob-test-_sxn168a", "pytest-of-root", "__", "A.B..C", "ÿ", "-x-", "tmpAB_cd9", ""):
        assert COMPONENT.match(repository_name(text)), text
    alphabet = string.ascii_letters + string.digits + "_-."
    for i in range(2000):  # every name mktemp could give: prefix + 8 of [A-Za-z0-9_]
        text = "perjob-test-" + "".join(alphabet[(i * 7 + k * 13) % len(alphabet)] for k in range(8))
        assert COMPONENT.match(repository_name(text)), text
