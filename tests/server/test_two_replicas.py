"""Two `orchard serve` replicas on one PostgreSQL (real processes, a real PostgreSQL the tests
start) in front of one local agent (the local backend's agent is found through its state
directory, so both replicas place sandboxes on it, as pods on one cluster).

200 sandboxes are created through both while one replica is SIGKILLed: every create the
client was told of is in the store, ready and usable through the survivor; every call the
killed replica did not answer failed with a connection error and, retried with the same
sandbox id on the survivor, created nothing twice; a create never retried is either whole
(the kill lost only its answer: it stays, usable) or dropped by the survivor, never left half
made; and reaping happens once, on the leader.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from tests.server import test_postgres_store
from tests.server.conftest import ServerProcess

postgres_server = test_postgres_store.postgres_server  # the fixtures: a PostgreSQL, a fresh database
database = test_postgres_store.database

ROUND = 'orchard_reconciler_actions_total{action="round"}'
SPEC = {"image": "host", "timeout": 60, "cpu": "1", "memory": "256Mi"}


def replicas(server_factory, database: str, **reconciler: float) -> tuple[ServerProcess, ServerProcess]:
    """Replica A starts first (and the shared agent with its first call), then B on A's agent."""
    settings = {"interval": 0.3, "lost_grace": 2.0, **reconciler}
    first = server_factory(store=database, reconciler=settings)
    with first.http() as http:
        assert http.get("/resources").status_code == 200  # starts the agent: B finds it running
    shared = {"name": "local", "settings": {"agent": {"state_dir": str(first.agent_state)}}}
    second = server_factory(store=database, reconciler=settings, backend=shared)
    return first, second


def agent_sandboxes(server: ServerProcess) -> list[str]:
    """What the shared agent really hosts (asked directly, not through a server)."""
    from orchard.agent.settings import AgentSettings
    from orchard.backends.local.launcher import running_agent

    settings = AgentSettings(state_dir=server.agent_state)
    info = running_agent(settings)
    assert info is not None
    token = (settings.agent_dir / "token").read_text().strip()
    transport = httpx.HTTPTransport(uds=info["address"].removeprefix("unix://"))
    with httpx.Client(transport=transport, base_url="http://agent", headers={"X-API-Key": token}, timeout=30) as c:
        return [s["sandbox_id"] for s in c.get("/sandboxes").json()["sandboxes"]]


def reconciler_actions(*servers: ServerProcess) -> list[tuple[str, str, str]]:
    """(replica log, action, sandbox id) of every reaping the replicas logged."""
    found = []
    for server in servers:
        for line in Path(server.log_path).read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("logger") == "orchard.server.reconciler" and "sandbox_id" in entry:
                found.append((server.url, entry["message"], entry["sandbox_id"]))
            elif entry.get("message") == "sandbox lost":
                found.append((server.url, "marked_lost", entry.get("sandbox_id", "?")))
    return found


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


@dataclass
class CreatesUnderAKill:
    """What 200 creates through two replicas, the first killed mid-way, came to."""

    acknowledged: dict[str, str]  # sandbox id -> the replica that answered
    outcomes_on_killed: dict[str, str]  # sandbox id -> "completed" or the connection error
    given_up: set[str]  # cut by the kill and never retried

    @property
    def cut(self) -> list[str]:
        return sorted(sid for sid, outcome in self.outcomes_on_killed.items() if outcome != "completed")


def create_while_killing_the_first(first: ServerProcess, second: ServerProcess, spec: dict[str, Any],
                                   client: Callable[[ServerProcess], httpx.Client], count: int = 200,
                                   kill_after: int = 70, diagnose: Callable[[], str] = lambda: "") -> CreatesUnderAKill:
    """``count`` creates, 16 at once, half to each replica; the first is SIGKILLed when the
    ``kill_after``-th is acknowledged. A call it did not answer is retried by id on the
    second, except every fourth, whose client gives up. ``diagnose``: more for a failure."""
    done = CreatesUnderAKill({}, {}, set())
    lock = threading.Lock()
    killed = threading.Event()

    def create(index: int) -> None:
        sandbox_id = f"two-replicas-{index:03d}"
        body = {**spec, "sandbox_id": sandbox_id}
        server = first if index % 2 == 0 else second
        try:
            with client(server) as http:
                answer = http.post("/sandboxes", json=body)
        except httpx.TransportError as exc:  # refused, reset or cut: the client may retry anywhere
            assert server is first and killed.is_set(), f"{sandbox_id} on {server.url}: {exc!r}"
            with lock:
                done.outcomes_on_killed[sandbox_id] = f"connection error: {type(exc).__name__}"
            if index % 4 == 2:  # this client gives up: its sandbox must not linger half made
                with lock:
                    done.given_up.add(sandbox_id)
                return
            with client(second) as http:
                answer = http.post("/sandboxes", json=body)  # the same id: idempotent
            server = second
        else:
            if server is first:
                with lock:
                    done.outcomes_on_killed[sandbox_id] = "completed"
        assert answer.status_code == 200, (sandbox_id, answer.status_code, answer.text, diagnose())
        assert answer.json()["status"] == "ready", answer.text
        with lock:
            done.acknowledged[sandbox_id] = server.url
            if len(done.acknowledged) == kill_after and not killed.is_set():
                killed.set()
                first.kill9()  # mid-way: creates are in flight on it

    with ThreadPoolExecutor(16) as pool:
        for future in [pool.submit(create, index) for index in range(count)]:
            future.result()
    assert killed.is_set()
    assert len(done.acknowledged) + len(done.given_up) == count
    assert done.cut, "no call to the killed replica was cut: the kill was not mid-way"
    return done


def test_200_sandboxes_through_two_replicas_one_killed(server_factory, database):
    first, second = replicas(server_factory, database)
    wait_until(lambda: ROUND in first.http().get("/metrics").text, 30,
               "the first replica's reconciler to run a round (it leads)")
    run = create_while_killing_the_first(first, second, SPEC, lambda server: server.http())
    acknowledged, given_up, errors = run.acknowledged, run.given_up, run.cut
    print(f"{len(acknowledged)} acknowledged, {len(errors)} calls cut or refused by the killed replica "
          f"({len(given_up)} not retried)")
    # A create the killed replica finished whose answer the kill lost is whole (ready, on the agent):
    # it stays, as any sandbox does, until deleted or idle. A create cut mid-way (pending, or not
    # recorded) and never retried is dropped by the survivor's reconciler (abandoned).
    with second.http() as http:
        status = {s["sandbox_id"]: s["status"] for s in http.get("/sandboxes").json()["sandboxes"]}
    made = {sid for sid in given_up if status.get(sid) == "ready"}
    abandoned = given_up - made
    wait_until(lambda: not abandoned & {s["sandbox_id"] for s in second.http().get("/sandboxes").json()["sandboxes"]},
               30, "the abandoned creates to be dropped")
    wait_until(lambda: not abandoned & set(agent_sandboxes(first)), 30, "the agent to drop the abandoned sandboxes")
    # nothing lost: every acknowledged (or whole) create is in the store, ready, and usable through the survivor
    existing = sorted(set(acknowledged) | made)
    with second.http() as http:
        listed = {s["sandbox_id"]: s for s in http.get("/sandboxes").json()["sandboxes"]}
        assert sorted(listed) == existing
        assert {s["status"] for s in listed.values()} == {"ready"}
        for sandbox_id in existing:
            run = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": f"echo {sandbox_id}", "wait": True})
            assert run.status_code == 200 and run.json()["stdout"].strip() == sandbox_id, run.text
    # nothing double-created: the agent hosts each sandbox once, and nothing else
    hosted = agent_sandboxes(first)
    assert sorted(hosted) == existing
    # the survivor took the reconciler over, and nothing was reaped: every sandbox is alive
    wait_until(lambda: ROUND in second.http().get("/metrics").text, 30, "the survivor's reconciler rounds")
    time.sleep(2 * 0.3 + 2.0)  # a few rounds past the lost grace, led by the survivor now
    actions = reconciler_actions(first, second)
    assert [a for a in actions if a[1] != "abandoned_create_deleted"] == [], actions  # no live sandbox reaped
    dropped = [sid for _, _, sid in actions]
    # each once, and only creates the kill cut: an abandoned one, or one the client retried that the
    # reconciler dropped before the retry made it again (the retry's sandbox is checked above)
    assert len(dropped) == len(set(dropped)) and set(dropped) <= set(errors) - made, actions
    print(f"{len(dropped)} abandoned creates dropped, {len(made)} whole creates whose answer was lost")
    with second.http() as http:
        for sandbox_id in existing:
            assert http.delete(f"/sandboxes/{sandbox_id}").status_code in (200, 204)
    assert agent_sandboxes(first) == []


def test_reaping_happens_once_and_moves_to_the_survivor(server_factory, database):
    first, second = replicas(server_factory, database, heartbeat_ttl=2.0)
    created = []
    for index in range(20):
        server = first if index % 2 == 0 else second
        with server.http() as http:
            answer = http.post("/sandboxes", json={**SPEC, "sandbox_id": f"reaped-{index:02d}"})
        assert answer.status_code == 200, answer.text
        created.append(f"reaped-{index:02d}")
    wait_until(lambda: agent_sandboxes(first) == [], 60, "the idle sandboxes to be reaped")
    # a reaping is logged once its sandbox is deleted: the log may trail the agent by a moment
    wait_until(lambda: len(reconciler_actions(first, second)) >= 20, 60, "the reapings to be logged")
    actions = reconciler_actions(first, second)
    assert sorted(sid for _, _, sid in actions) == sorted(created), actions  # each once
    assert {action for _, action, _ in actions} == {"expired"}
    assert len({url for url, _, _ in actions}) == 1  # by one replica: the leader
    leader = first if actions[0][0] == first.url else second
    survivor = second if leader is first else first
    leader.kill9()
    with survivor.http() as http:
        for index in range(5):
            assert http.post("/sandboxes", json={**SPEC, "sandbox_id": f"later-{index}"}).status_code == 200
    wait_until(lambda: agent_sandboxes(first) == [], 60, "the survivor to reap the later sandboxes")

    def later_reaped() -> list[tuple[str, str]]:
        return [(url, sid) for url, _, sid in reconciler_actions(first, second) if sid.startswith("later-")]

    wait_until(lambda: len(later_reaped()) >= 5, 60, "the later reapings to be logged")
    later = later_reaped()
    assert sorted(later) == sorted((survivor.url, f"later-{index}") for index in range(5))
