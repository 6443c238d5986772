"""Per-sandbox agent tokens: a caller given one can use its own sandbox, nothing else.

A token is an HMAC of the sandbox id under the agent's key, so the agent checks it
without storing anything, and whoever holds the agent key (the server) can hand it out.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "sbx."


def sandbox_token(agent_key: str, sandbox_id: str) -> str:
    digest = hmac.new(agent_key.encode(), sandbox_id.encode(), hashlib.sha256).hexdigest()
    return PREFIX + digest[:48]


def token_matches(given: str, agent_key: str, sandbox_id: str) -> bool:
    return given.startswith(PREFIX) and hmac.compare_digest(given.encode(), sandbox_token(agent_key, sandbox_id).encode())
