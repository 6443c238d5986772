"""Wire models of the Orchard Env API (compatible with the original service).

Requests ignore unknown fields and treat null as "use the default", so clients of
the original keep working; invalid values of known fields are rejected with 422.
"""

from __future__ import annotations

import re
import shlex
import time
from typing import Any, Callable, ClassVar, Literal, Optional, Union

from pydantic import (
    BaseModel, ConfigDict, Field, GetJsonSchemaHandler, ValidationError, field_validator, model_validator,
)
from pydantic.json_schema import JsonSchemaValue

from orchard.quantities import (
    CPU_PATTERN, PIDS_MAX, PIDS_MIN, PIDS_RULE, QUANTITY_PATTERN, check_pids, parse_cpu, parse_disk, parse_memory,
)

SandboxStatus = Literal["pending", "ready", "failed", "lost", "deleted"]
JobStatus = Literal["queued", "running", "succeeded", "failed"]
ErrorType = Literal["timeout", "sandbox_lost", "agent_unreachable", "rejected", "internal"]
SANDBOX_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
# Job ids (body ``job_id`` or the ``Idempotency-Key`` header) end up in /jobs/{job_id} URLs:
# a letter or digit first, so "." and ".." (which clients normalize away) are never ids.
JOB_ID_PATTERN = SANDBOX_ID_PATTERN
# what base64.b64decode(validate=True) takes: the alphabet, padded to a multiple of four
BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
JOB_ID_RULE = "must be 1-63 characters of A-Z, a-z, 0-9, '_', '.', '-', starting with a letter or digit"
_JOB_ID = re.compile(JOB_ID_PATTERN)
DEFAULT_EXEC_TIMEOUT = 300.0
MAX_COMMAND_CHARS = 1 << 20


def valid_job_id(value: object) -> bool:
    return isinstance(value, str) and _JOB_ID.fullmatch(value) is not None


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_env(env: dict[str, str]) -> dict[str, str]:
    """Names that execve can pass on (no '=', no NUL, not empty), values without NUL: a bad
    one taken at create would break every later command of the sandbox."""
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"env names must be non-empty, without '=' or NUL; got {_show(name)}")
        if "\0" in value:
            raise ValueError(f"env value of {_show(name)} contains a NUL byte")
    return env


# What the env validators enforce, said in the schema too: names execve can pass on, values
# without NUL.
ENV_SCHEMA = {"propertyNames": {"pattern": "^[^=\u0000]+$"}, "additionalProperties": {"type": "string",
                                                                                    "pattern": "^[^\u0000]*$"}}


COMMAND_SCHEMA = {"anyOf": [
    {"type": "string", "maxLength": MAX_COMMAND_CHARS, "pattern": "^[^\u0000]*\\S[^\u0000]*$",
     "description": "run by bash -c (sh -c without bash)"},
    {"type": "array", "minItems": 1, "items": {"type": "string", "pattern": "^[^\u0000]*$"},
     "description": f"argv, joined with shlex.join (at most {MAX_COMMAND_CHARS} characters then)"},
]}


def _text_problem(value: object) -> bool:
    """True when ``value`` holds a string that is no UTF-8 text (a lone surrogate, which
    JSON can carry as an escape): it could not be passed to a command or stored."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_text_problem(k) or _text_problem(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_text_problem(item) for item in value)
    return False


class Request(BaseModel):
    # Booleans and numbers are strict (true/false; numbers, not "5"; 0.0 is no boolean and true
    # no number, though pydantic takes both by default), so the served schema says what is taken.
    model_config = ConfigDict(extra="ignore")
    # Fields where null means "the default" (clients of the original service send nulls): the
    # served schema says so, or a client generated from it could not send them (the long API
    # fuzz found block_network: null accepted while the schema said boolean).
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(core_schema)
        properties = handler.resolve_ref_schema(schema).get("properties", {})
        for name in cls.NULL_IS_DEFAULT:
            field = properties[name]
            kept = {key: field.pop(key) for key in ("title", "default", "description") if key in field}
            properties[name] = {"anyOf": [field, {"type": "null"}], **kept}
        return schema

    @model_validator(mode="after")
    def _utf8_only(self) -> "Request":
        for name in type(self).model_fields:
            if _text_problem(getattr(self, name)):
                raise ValueError(f"{name} is not valid UTF-8 text (it holds a lone surrogate escape)")
        return self


class SandboxSpec(Request):
    """Body of ``POST /sandboxes``."""

    NULL_IS_DEFAULT = ("image", "block_network", "env", "labels")

    image: str = Field("host", min_length=1, max_length=4096,
                       description="'host', a root filesystem directory, or docker://REF")
    block_network: bool = Field(True, strict=True)
    sandbox_id: Optional[str] = Field(None, pattern=SANDBOX_ID_PATTERN)
    cpu: Optional[str] = Field(None, description="CPUs, '4' or '2000m': 0.01 to 1024",
                               json_schema_extra={"pattern": CPU_PATTERN})
    memory: Optional[str] = Field(None, description="memory limit, e.g. '16Gi': a whole number of bytes from 16Mi "
                                                    "to 64Ti", json_schema_extra={"pattern": QUANTITY_PATTERN})
    disk: Optional[str] = Field(None, description="writable-layer quota, e.g. '10Gi': a whole number of bytes from "
                                                  "1Mi to 64Ti", json_schema_extra={"pattern": QUANTITY_PATTERN})
    pids: Optional[int] = Field(None, ge=PIDS_MIN, le=PIDS_MAX, description="max processes (a whole number, or one "
                                "written as a string, as Kubernetes quantities are)")
    timeout: Optional[float] = Field(None, gt=0, le=3600, strict=True, description="seconds to wait for readiness")
    env: dict[str, str] = Field(default_factory=dict, json_schema_extra=ENV_SCHEMA)
    labels: dict[str, str] = Field(default_factory=dict)
    snapshot: Optional[str] = Field(None, pattern=SANDBOX_ID_PATTERN,
                                    description="start from this snapshot (a fork) instead of the bare image; "
                                                "image must then be the snapshot's")

    @field_validator("env", "labels", mode="before")
    @classmethod
    def _null_is_empty(cls, value: object) -> object:
        return {} if value is None else value

    @field_validator("block_network", mode="before")
    @classmethod
    def _null_blocks(cls, value: object) -> object:
        return True if value is None else value

    @field_validator("image", mode="before")
    @classmethod
    def _null_image(cls, value: object) -> object:
        return "host" if value is None else value

    @field_validator("cpu", mode="before")
    @classmethod
    def _check_cpu(cls, value: object) -> object:
        if value is not None:
            parse_cpu(value)  # type: ignore[arg-type]  # raises ValueError -> 422 with the field path
            return str(value)
        return value

    @field_validator("memory", "disk", mode="before")
    @classmethod
    def _check_size(cls, value: object, info: Any) -> object:
        if value is not None:
            (parse_memory if info.field_name == "memory" else parse_disk)(value)  # type: ignore[arg-type]
            return str(value)
        return value

    @field_validator("pids", mode="wrap")
    @classmethod
    def _check_pids(cls, value: object, handler: Callable[[object], Optional[int]]) -> Optional[int]:
        try:
            pids = handler(value)
        except ValidationError as exc:  # out of the schema's bounds: say the real range
            if not any(e["type"] in ("greater_than_equal", "less_than_equal") for e in exc.errors()):
                raise
            raise ValueError(f"{PIDS_RULE}, got {_show(value)}") from None
        return None if pids is None else check_pids(pids)

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    def identity(self) -> dict:
        """What must match for a repeated create with the same id to be idempotent."""
        return self.model_dump(exclude={"sandbox_id", "timeout"})


class Sandbox(BaseModel):
    """A sandbox as every route returns it."""

    sandbox_id: str
    image: str
    status: SandboxStatus
    ready: bool = False
    status_message: Optional[str] = None
    block_network: bool = True
    cpu: Optional[str] = None
    memory: Optional[str] = None
    disk: Optional[str] = None
    pids: Optional[int] = None
    labels: dict[str, str] = Field(default_factory=dict)
    backend: str = "local"
    runtime: Optional[str] = None
    created_at: float = Field(default_factory=time.time)
    agent_url: Optional[str] = Field(None, description="create response only: the agent, for the direct hot path")
    agent_token: Optional[str] = Field(None, description="create response only: a token for this sandbox alone")
    incarnation: Optional[str] = Field(None, description="which life of this sandbox id (tokens are bound to it)")


class ExecRequest(Request):
    """Body of ``POST /sandboxes/{id}/exec``."""

    NULL_IS_DEFAULT = ("env", "login_shell", "wait")

    command: Union[str, list[str]] = Field(json_schema_extra=COMMAND_SCHEMA)
    timeout_seconds: Optional[float] = Field(None, gt=0, le=7 * 24 * 3600, strict=True)
    idle_timeout_seconds: Optional[float] = Field(None, gt=0, le=7 * 24 * 3600, strict=True)
    cwd: Optional[str] = Field(None, min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict, json_schema_extra=ENV_SCHEMA)
    login_shell: bool = Field(False, strict=True)
    wait: bool = Field(False, strict=True)
    stdin: Optional[str] = Field(None, max_length=64 << 20)
    job_id: Optional[str] = Field(None, pattern=JOB_ID_PATTERN, description="idempotency key")

    @field_validator("env", mode="before")
    @classmethod
    def _null_env(cls, value: object) -> object:
        return {} if value is None else value

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @field_validator("login_shell", "wait", mode="before")
    @classmethod
    def _null_false(cls, value: object) -> object:
        return False if value is None else value

    @field_validator("command")
    @classmethod
    def _check_command(cls, value: Union[str, list[str]]) -> Union[str, list[str]]:
        text = value if isinstance(value, str) else shlex.join(value)
        if not text.strip():
            raise ValueError("command is empty")
        if len(text) > MAX_COMMAND_CHARS:
            raise ValueError(f"command is longer than {MAX_COMMAND_CHARS} characters; upload a script instead")
        if "\0" in text:
            raise ValueError("command contains a NUL byte")
        return value

    def command_text(self) -> str:
        return self.command if isinstance(self.command, str) else shlex.join(self.command)

    def effective_timeout(self) -> float:
        return self.timeout_seconds if self.timeout_seconds is not None else DEFAULT_EXEC_TIMEOUT


class Job(BaseModel):
    """A command's record: ``{job_id, sandbox_id, command, status, stdout, ...}``."""

    job_id: str
    sandbox_id: str
    command: str
    status: JobStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: Optional[int] = None
    created_at: float
    started_at: Optional[float] = None
    completed_at: Optional[float] = None
    error: Optional[str] = None
    error_type: Optional[ErrorType] = None
    truncated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.error_type is None


class QueuedJob(BaseModel):
    job_id: str
    status: JobStatus = "queued"


class FileUpload(Request):
    path: str = Field(min_length=1, max_length=4096)
    # the pattern is published, not checked here: the agent decodes strictly (422 otherwise)
    content: str = Field(description="base64", json_schema_extra={"pattern": BASE64_PATTERN})
    mode: Optional[int] = Field(None, ge=0, le=0o7777)

    @field_validator("mode", mode="before")
    @classmethod
    def _json_integer(cls, value: object) -> object:
        if isinstance(value, (str, bool)):  # JSON's integers only (1935.0 is one): not "1935", not true
            raise ValueError("mode must be a whole number")
        return value


class FileUploaded(BaseModel):
    success: bool = True
    path: str
    size: int


class FileContent(BaseModel):
    path: str
    content: str
    size: int


class FileEntry(BaseModel):
    name: str
    type: Literal["file", "directory", "symlink", "other"]
    size: int
    modified: float


class FileList(BaseModel):
    path: str
    files: list[FileEntry]
    total: Optional[int] = Field(None, description="entries in the directory (pages: offset, limit)")
    offset: int = 0
    next_offset: Optional[int] = Field(None, description="offset of the next page; null on the last")


class SnapshotRequest(Request):
    """Body of ``POST /sandboxes/{id}/snapshot``."""

    snapshot_id: Optional[str] = Field(None, pattern=SANDBOX_ID_PATTERN, description="chosen by the caller "
                                       "(idempotent: the same id for the same sandbox returns the same snapshot)")


class Snapshot(BaseModel):
    """A frozen filesystem state of a sandbox that new sandboxes fork from (copy-on-write)."""

    snapshot_id: str
    sandbox_id: str = Field(description="the sandbox it was taken of")
    image: str
    parent: Optional[str] = Field(None, description="the snapshot that sandbox was itself forked from")
    created_at: float = Field(default_factory=time.time)
    size_bytes: int = Field(0, description="bytes written since the image (or the parent snapshot)")
    forks: int = Field(0, description="sandboxes and snapshots that still use it")
    deleting: bool = Field(False, description="deleted, kept until its last fork is gone")
    backend: Optional[str] = None


class PatchRequest(Request):
    patch: str = Field(min_length=1)
    timeout_seconds: Optional[float] = Field(None, gt=0, le=3600, strict=True)


class PatchResult(BaseModel):
    success: bool
    stdout: str
    stderr: str
    exit_code: Optional[int]
