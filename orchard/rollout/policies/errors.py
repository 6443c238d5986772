"""What a policy raises when it cannot produce a turn (a rollout loop ends the rollout on these)."""

from __future__ import annotations

from typing import Optional


class PolicyError(RuntimeError):
    """Base of every error a policy raises on purpose."""


class PolicyServerError(PolicyError):
    """The model server refused or failed a request (after the retries, when it was retryable).

    ``status`` is the HTTP status (None: no answer at all, e.g. connection refused) and
    ``server_message`` what the server said, so a log line names both.
    """

    def __init__(self, status: Optional[int], server_message: str, *, url: str = "", attempts: int = 1) -> None:
        self.status = status
        self.server_message = server_message
        self.url = url
        self.attempts = attempts
        what = f"HTTP {status}" if status is not None else "no response"
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"{url or 'model server'}: {what}{tries}: {server_message}")


class PolicyResponseError(PolicyError):
    """The server answered 200 but not with a usable chat completion (bad JSON, missing fields,
    token ids and log-probs that do not line up)."""


class TokenContextMismatch(PolicyError):
    """The tokens a server conditioned on do not extend the tokens recorded so far.

    A chat-completions server re-renders and re-tokenizes the whole conversation each turn;
    when that does not reproduce the recorded tokens (a template that rewrites history, a
    sampled token sequence that re-tokenizes differently), the rollout cannot be one exact
    token sequence, and training on it would be silently off-policy.
    """

    def __init__(self, index: int, recorded: list[int], served: list[int]) -> None:
        self.index = index
        window = slice(max(0, index - 3), index + 5)
        super().__init__(f"the server's prompt differs from the recorded context at token {index} "
                         f"(recorded {recorded[window]}, served {served[window]}); the chat template or "
                         f"re-tokenization does not reproduce earlier turns")
