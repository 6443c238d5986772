"""Per-sandbox agent tokens: a caller given one can use its own sandbox, nothing else.

A token is an HMAC, under the agent's key, of the sandbox id *and its incarnation* (a
random value the agent gives each sandbox it creates), so the agent checks it without
storing anything, whoever holds the agent key (the server) can hand it out, and a token
dies with its sandbox: it does not open a later sandbox created with the same id.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "sbx."


def sandbox_token(agent_key: str, sandbox_id: str, incarnation: str) -> str:
    message = f"{sandbox_id}\0{incarnation}".encode()
    return PREFIX + hmac.new(agent_key.encode(), message, hashlib.sha256).hexdigest()[:48]


def token_matches(given: str, agent_key: str, sandbox_id: str, incarnation: str) -> bool:
    expected = sandbox_token(agent_key, sandbox_id, incarnation)
    return given.startswith(PREFIX) and hmac.compare_digest(given.encode(), expected.encode())
