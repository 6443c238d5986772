"""Typed errors that cross the wire and come back as the same type in the SDK.

Every error has an HTTP status and a stable ``type`` name. The body shape is
``{"detail": message, "error": {"type": name, "message": message}}``.
"""

from __future__ import annotations


class OrchardError(Exception):
    """Base of every error Orchard raises on purpose."""

    status_code = 500
    error_type = "internal"  # the job-level error_type this maps to, where it applies
    retryable = False  # would the same request, sent again, likely succeed? (clients retry only these)

    def __init__(self, message: str = "", *, retryable: bool | None = None) -> None:
        super().__init__(message or self.__class__.__doc__ or self.__class__.__name__)
        self.message = str(self.args[0])
        if retryable is not None:  # this one differs from its type's rule
            self.retryable = retryable

    def to_body(self) -> dict:
        return {"detail": self.message,
                "error": {"type": type(self).__name__, "message": self.message, "retryable": self.retryable}}


class InvalidRequest(OrchardError):
    """The request is well-formed JSON but asks for something impossible."""

    status_code = 422
    error_type = "rejected"


class AuthenticationFailed(OrchardError):
    """Missing or wrong API key."""

    status_code = 401
    error_type = "rejected"


class SandboxNotFound(OrchardError):
    """No sandbox with this id exists (it never did, or it was deleted)."""

    status_code = 404
    error_type = "rejected"


class JobNotFound(OrchardError):
    """No job with this id exists (it never did, or its record expired)."""

    status_code = 404
    error_type = "rejected"


class SandboxConflict(OrchardError):
    """A sandbox with this id already exists with a different spec."""

    status_code = 409
    error_type = "rejected"


class SandboxLost(OrchardError):
    """The sandbox died underneath us (holder killed, pod evicted, job cancelled)."""

    status_code = 410
    error_type = "sandbox_lost"


class SandboxNotReady(OrchardError):
    """The sandbox exists but is not ready for commands yet."""

    status_code = 409
    error_type = "rejected"


class ImageRejected(OrchardError):
    """The image does not exist, cannot be pulled, or a policy refused it."""

    status_code = 422
    error_type = "rejected"


class QuotaExceeded(OrchardError):
    """A resource limit (sandboxes, disk, memory) would be exceeded."""

    status_code = 429
    error_type = "rejected"


class RuntimeUnavailable(OrchardError):
    """The isolation runtime cannot run here (e.g. bubblewrap is missing)."""

    status_code = 503
    error_type = "rejected"


class StateDirInUse(RuntimeUnavailable):
    """Another live agent already serves this state directory (one agent per state dir)."""


class SandboxIdBusy(RuntimeUnavailable):
    """A sandbox id whose deleted predecessor's processes are still being cleaned up (transient)."""

    retryable = True


class BackendUnavailable(OrchardError):
    """The backend is not usable on this machine or is temporarily down."""

    status_code = 503
    error_type = "agent_unreachable"


class AgentUnreachable(OrchardError):
    """The exec agent could not be reached (transient: retry)."""

    status_code = 503
    error_type = "agent_unreachable"
    retryable = True


class FileOperationFailed(OrchardError):
    """A file call failed inside the sandbox (missing path, not a file, escape attempt)."""

    status_code = 422
    error_type = "rejected"


class PayloadTooLarge(OrchardError):
    """A request body or a file is larger than the configured limit of this route."""

    status_code = 413
    error_type = "rejected"


class WaitTimeout(OrchardError):
    """A server-side wait ended before the sandbox or job was done."""

    status_code = 408
    error_type = "timeout"


class ExecTimeout(OrchardError):
    """A command ran past its timeout and was killed (raised by ``check=True`` helpers)."""

    status_code = 408
    error_type = "timeout"


class SnapshotNotFound(OrchardError):
    """No snapshot with this id (never taken, deleted, or lost with its agent)."""

    status_code = 404
    error_type = "rejected"


class Unsupported(OrchardError):
    """The backend or the sandbox lacks an optional capability (snapshots, say) this call needs."""

    status_code = 422
    error_type = "rejected"


class StoreUnavailable(OrchardError):
    """The server could not read or write its state store (disk full, I/O error); nothing was
    recorded, so the same request can be sent again once the store is back."""

    status_code = 503
    error_type = "internal"
    retryable = True


class StoreRecordDamaged(OrchardError):
    """A record in the server's state store cannot be read (changed outside the server, or
    damaged on disk). Calls on that record fail with this; listings and the reconciler skip
    it (logged), so one damaged record stops nothing else; DELETE still deletes its sandbox."""

    status_code = 500
    error_type = "internal"


class InternalError(OrchardError):
    """A bug: please report it with the agent's log."""

    status_code = 500
    error_type = "internal"


class AnswerTooLarge(InternalError):
    """An answer was larger than its caller's cap; it was not read whole."""


ERRORS_BY_NAME: dict[str, type[OrchardError]] = {
    cls.__name__: cls
    for cls in [
        OrchardError, InvalidRequest, AuthenticationFailed, SandboxNotFound, JobNotFound,
        SandboxConflict, SandboxLost, SandboxNotReady, ImageRejected, QuotaExceeded,
        RuntimeUnavailable, BackendUnavailable, AgentUnreachable, FileOperationFailed,
        PayloadTooLarge, WaitTimeout, ExecTimeout, InternalError, SnapshotNotFound, Unsupported,
        StoreUnavailable, StoreRecordDamaged, AnswerTooLarge, StateDirInUse, SandboxIdBusy,
    ]
}


def error_from_body(status_code: int, body: object) -> OrchardError:
    """Rebuild the typed error a server sent (falls back on the status code)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("type") in ERRORS_BY_NAME:
            return ERRORS_BY_NAME[err["type"]](str(err.get("message", "")))
        detail = body.get("detail")
        message = detail if isinstance(detail, str) else repr(detail)
        if status_code in (404, 405) and detail in ("Not Found", "Method Not Allowed"):
            return InternalError(f"HTTP {status_code}: the server has no such route (is it an older version?)")
    else:
        message = str(body)
    by_status = {401: AuthenticationFailed, 403: AuthenticationFailed, 404: SandboxNotFound,
                 408: WaitTimeout, 409: SandboxConflict, 410: SandboxLost, 413: PayloadTooLarge, 422: InvalidRequest,
                 503: AgentUnreachable}
    return by_status.get(status_code, InternalError)(f"HTTP {status_code}: {message}")


class CommandFailed(OrchardError):
    """A command exited non-zero and the caller asked for ``check=True``."""

    status_code = 200
    error_type = "rejected"


ERRORS_BY_NAME["CommandFailed"] = CommandFailed
