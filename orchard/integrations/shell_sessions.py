"""Named shell sessions over stateless exec: what a harness's "bash session" keeps between
commands (working directory, exported variables, shell functions) is saved to a file inside
the sandbox after each command and restored before the next.

Orchard runs every command in a fresh ``bash -c`` (serialized per sandbox, killed as a group
on timeout), which is what makes timeouts and lost sandboxes clean; harnesses such as
SWE-ReX expect one long-lived shell per session instead. Replaying the state gives them the
part of that they rely on, without a shell process that a timeout would leave half-dead.
Not kept: unexported variables, shell options, aliases and background jobs' job control.
"""

from __future__ import annotations

import re
import shlex

SESSION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
STATE_DIR = "/tmp/.orchard-sessions"


def state_path(session: str) -> str:
    """Where a session's state lives in the sandbox; the name is checked, never interpolated raw."""
    if not SESSION_NAME.match(session):
        raise ValueError(f"session name {session!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return f"{STATE_DIR}/{session}.sh"


def session_command(session: str, command: str, *, merge_stderr: bool = True) -> str:
    """``command`` wrapped so it starts from the session's saved state and saves the state it
    leaves, whatever way it ends (an ``exit`` included); its exit status is kept."""
    state = shlex.quote(state_path(session))
    lines = [
        "exec 2>&1" if merge_stderr else ":",
        f"if [ -r {state} ]; then . {state} >/dev/null 2>&1; fi",
        "__orchard_save() { { export -p; declare -f; printf 'cd -- %q\\n' \"$PWD\"; } "
        f"> {state}.tmp 2>/dev/null && mv -f {state}.tmp {state}; }}",
        "trap '__orchard_rc=$?; __orchard_save; exit $__orchard_rc' EXIT",
        command,
    ]
    return "\n".join(lines)


def start_command(session: str, startup_source: list[str]) -> str:
    """A new session: an empty state, then the startup files sourced into it (their output kept)."""
    state = shlex.quote(state_path(session))
    sources = "\n".join(f". {shlex.quote(path)}" for path in startup_source)
    return f"mkdir -p {STATE_DIR} && chmod 700 {STATE_DIR} && : > {state}\n" + session_command(session, sources or ":")


def close_command(session: str) -> str:
    return f"rm -f -- {shlex.quote(state_path(session))}"
