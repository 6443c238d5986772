"""The service believes an agent only about the sandboxes placed on it: a per-job agent
shares its container with hostile code. The agents here are TEST DOUBLES answering a
listing with whatever a hostile sandbox could make them say."""

from __future__ import annotations

import asyncio
from pathlib import Path

from orchard_slurm.backend import SlurmBackend
from orchard_slurm.pool import Pilot
from slurm_testing import slurm_settings


class LyingAgent:
    """Stands in for a taken-over agent: lists a neighbour's sandbox as its own, and lost."""

    def __init__(self, own: str, neighbour: str) -> None:
        self.own, self.neighbour = own, neighbour

    async def request(self, method: str, path: str, **kwargs: object) -> dict:
        return {"sandboxes": [{"sandbox_id": self.own, "image": "x", "status": "ready"},
                              {"sandbox_id": self.neighbour, "image": "x", "status": "lost",
                               "status_message": "forged by a neighbour"}]}


class UnreadableAgent:
    async def request(self, method: str, path: str, **kwargs: object) -> dict:
        raise RecursionError("a deeply nested answer")


def test_a_listing_is_believed_only_about_the_agents_own_sandboxes():
    backend = SlurmBackend.from_settings(slurm_settings(mode="per-job", runtime="bwrap"))
    attacker = Pilot("pilot-a", "1", Path("/nonexistent"), 0.0, 600.0, sandboxes={"sbx-attacker"})
    attacker.api = LyingAgent("sbx-attacker", "sbx-victim")  # type: ignore[assignment]
    backend.pool.owner.update({"sbx-attacker": "pilot-a", "sbx-victim": "pilot-b"})
    listed = asyncio.run(backend._listed_by(backend.site(attacker)))
    assert [s.sandbox_id for s in listed] == ["sbx-attacker"]  # the victim's forged "lost" is dropped
    broken = Pilot("pilot-b", "2", Path("/nonexistent"), 0.0, 600.0, sandboxes={"sbx-victim"})
    broken.api = UnreadableAgent()  # type: ignore[assignment]
    kept = asyncio.run(backend._listed_by(backend.site(broken)))
    assert [(s.sandbox_id, s.status) for s in kept] == [("sbx-victim", "ready")]  # kept as it was, listing goes on
