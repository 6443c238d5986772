"""Wire models of the Orchard Env API (compatible with the original service).

Requests ignore unknown fields and treat null as "use the default", so clients of
the original keep working; invalid values of known fields are rejected with 422.
"""

from __future__ import annotations

import shlex
import time
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchard.quantities import parse_bytes, parse_cpu

SandboxStatus = Literal["pending", "ready", "failed", "lost", "deleted"]
JobStatus = Literal["queued", "running", "succeeded", "failed"]
ErrorType = Literal["timeout", "sandbox_lost", "agent_unreachable", "rejected", "internal"]
SANDBOX_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
DEFAULT_EXEC_TIMEOUT = 300.0
MAX_COMMAND_BYTES = 1 << 20


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SandboxSpec(Request):
    """Body of ``POST /sandboxes``."""

    image: str = Field("host", min_length=1, max_length=4096,
                       description="'host', a root filesystem directory, or docker://REF")
    block_network: bool = True
    sandbox_id: Optional[str] = Field(None, pattern=SANDBOX_ID_PATTERN)
    cpu: Optional[str] = Field(None, description="CPUs, '4' or '2000m'")
    memory: Optional[str] = Field(None, description="memory limit, e.g. '16Gi'")
    disk: Optional[str] = Field(None, description="writable-layer quota, e.g. '10Gi'")
    pids: Optional[int] = Field(None, gt=0, le=1 << 22, description="max processes")
    timeout: Optional[float] = Field(None, gt=0, le=3600, description="seconds to wait for readiness")
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)

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
            parse_cpu(value)  # raises ValueError -> 422 with the field path
            return str(value)
        return value

    @field_validator("memory", "disk", mode="before")
    @classmethod
    def _check_size(cls, value: object) -> object:
        if value is not None:
            parse_bytes(value)
            return str(value)
        return value

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


class ExecRequest(Request):
    """Body of ``POST /sandboxes/{id}/exec``."""

    command: Union[str, list[str]]
    timeout_seconds: Optional[float] = Field(None, gt=0, le=7 * 24 * 3600)
    idle_timeout_seconds: Optional[float] = Field(None, gt=0, le=7 * 24 * 3600)
    cwd: Optional[str] = Field(None, min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    login_shell: bool = False
    wait: bool = False
    stdin: Optional[str] = Field(None, max_length=64 << 20)
    job_id: Optional[str] = Field(None, pattern=SANDBOX_ID_PATTERN, description="idempotency key")

    @field_validator("env", mode="before")
    @classmethod
    def _null_env(cls, value: object) -> object:
        return {} if value is None else value

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
        if len(text.encode()) > MAX_COMMAND_BYTES:
            raise ValueError(f"command is longer than {MAX_COMMAND_BYTES} bytes; upload a script instead")
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
    content: str = Field(description="base64")
    mode: Optional[int] = Field(None, ge=0, le=0o7777)


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


class PatchRequest(Request):
    patch: str = Field(min_length=1)
    timeout_seconds: Optional[float] = Field(None, gt=0, le=3600)


class PatchResult(BaseModel):
    success: bool
    stdout: str
    stderr: str
    exit_code: Optional[int]
