"""Sandbox host ids: never an account's, a subordinate range's, or another agent's."""

from __future__ import annotations

import os

import pytest

from orchard.agent import host_ids
from orchard.agent.host_ids import DEFAULT_HOST_UID, HostIdPool, claim_host_ids, clashing_accounts


@pytest.fixture
def claims_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(host_ids, "CLAIMS_DIR", tmp_path / "claims")
    return tmp_path


def test_two_agents_get_disjoint_ranges_and_a_dead_agents_range_is_free_again(claims_dir):
    first = claim_host_ids(DEFAULT_HOST_UID, DEFAULT_HOST_UID, 100, search=4)
    second = claim_host_ids(DEFAULT_HOST_UID, DEFAULT_HOST_UID, 100, search=4)
    assert first[0] == DEFAULT_HOST_UID and second[0] == DEFAULT_HOST_UID + 100
    with pytest.raises(OSError, match="held by another agent"):
        claim_host_ids(DEFAULT_HOST_UID + 150, DEFAULT_HOST_UID + 150, 10, search=1)  # overlaps the second
    os.close(first[2])  # that agent died
    again = claim_host_ids(DEFAULT_HOST_UID, DEFAULT_HOST_UID, 100, search=4)
    assert again[0] == DEFAULT_HOST_UID
    for claim in (second, again):
        os.close(claim[2])


def test_subordinate_ranges_count_as_taken(claims_dir, monkeypatch):
    """/etc/subuid gave a local user the sandboxes' default ids: through a mapped uid it read
    and wrote other sandboxes and the shared image cache."""
    subuid = claims_dir / "subuid"
    subuid.write_text(f"someone:{DEFAULT_HOST_UID + 5}:65536\n")
    monkeypatch.setattr(host_ids, "SUBUID_FILE", subuid)
    assert clashing_accounts(DEFAULT_HOST_UID, DEFAULT_HOST_UID, 10) == [
        f"{subuid} entry someone:{DEFAULT_HOST_UID + 5}:65536"]
    with pytest.raises(OSError, match="someone"):
        claim_host_ids(DEFAULT_HOST_UID, DEFAULT_HOST_UID, 10, search=1)
    uid, _, fd = claim_host_ids(DEFAULT_HOST_UID, DEFAULT_HOST_UID, 65536, search=3)
    assert uid >= DEFAULT_HOST_UID + 5 + 65536 or uid + 65536 <= DEFAULT_HOST_UID + 5
    os.close(fd)


def test_the_first_id_of_a_range_is_never_a_sandboxs():
    pool = HostIdPool(1000, 2000, 3)
    assert pool.take() == (1001, 2001) and pool.take() == (1002, 2002) and pool.take() is None
