"""Server configuration: one YAML file, flags for the common settings, typed errors.

The backend section names a backend and its settings; the settings are validated by
that backend's own config model, so an error points at ``backend.settings.<key>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, FilePath, SecretStr, ValidationError, model_validator

from orchard.agent.settings import default_state_dir
from orchard.backends.api import Backend
from orchard.backends.loading import load_backend
from orchard.errors import InvalidRequest
from orchard.server.store import SQLiteStore, Store


class BackendSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("local", description="an installed backend (see `orchard backends`)")
    settings: dict[str, Any] = Field(default_factory=dict, description="validated by the backend's own model")


class ReconcilerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    interval: float = Field(5.0, gt=0, description="seconds between rounds")
    heartbeat_ttl: Optional[float] = Field(600.0, gt=0, description="delete sandboxes not heard from for this long")
    max_lifetime: Optional[float] = Field(None, gt=0, description="delete sandboxes older than this (absolute TTL)")
    list_timeout: float = Field(10.0, gt=0, description="a backend list slower than this skips the round")
    lost_grace: float = Field(10.0, ge=0, description="age before a sandbox missing from the backend counts as lost")


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: Optional[SecretStr] = Field(None, description="X-API-Key callers must send (ORCHARD_API_KEY)")
    state: Path = Field(default_factory=lambda: default_state_dir() / "server.db", description="SQLite file")
    store: Optional[str] = Field(None, pattern=r"^postgres(ql)?://",
                                 description="postgresql://... : a PostgreSQL store shared by several replicas "
                                             "(pip install psycopg); unset: the SQLite file at state")
    store_call_timeout: float = Field(10.0, gt=0, le=3600, description="seconds one PostgreSQL store call may "
                                      "take before its connection is given up (503): PostgreSQL hung or unreachable")
    tls_cert: Optional[FilePath] = Field(None, description="PEM certificate (chain) to serve HTTPS with; clients "
                                         "that pin it (ca_file, or SSL_CERT_FILE) cannot be answered by anything "
                                         "else that gets the port, such as a process waiting for it during a restart")
    tls_key: Optional[FilePath] = Field(None, description="the certificate's PEM private key (with tls_cert)")
    max_connections: int = Field(4096, ge=16, description="connections served at once; more are closed as they "
                                 "arrive (an idle connection costs the server a descriptor until it goes)")
    header_timeout: float = Field(10.0, gt=0, le=3600, description="seconds a connection has to send a request's "
                                  "head (request line and headers) once it connected or began the request; a "
                                  "slower one is closed")
    backend: BackendSection = Field(default_factory=BackendSection)
    reconciler: ReconcilerSettings = Field(default_factory=ReconcilerSettings)
    max_concurrent_exec: int = Field(1024, gt=0, description="commands in flight through this server")
    job_retention_seconds: float = Field(3600.0, gt=0)
    job_retention_bytes: int = Field(512 << 20, gt=0, description="stored finished jobs (their output as JSON) kept "
                                     "over all sandboxes; the oldest go first, as the agent's job_retention_bytes")
    max_body_bytes: int = Field(96 << 20, ge=1 << 20, description="largest JSON request body (413 above)")
    max_upload_bytes: Optional[int] = Field(None, ge=1, description="largest raw upload, streamed to the agent "
                                                                    "(default: the sandbox's disk quota decides)")
    log_level: str = "info"

    @model_validator(mode="after")
    def _tls_pair(self) -> "ServerConfig":
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both, or neither")
        return self

    def make_store(self) -> Store:
        if self.store:
            from orchard.server.postgres import PostgresStore  # psycopg only where it is used

            return PostgresStore(self.store, self.store_call_timeout)
        return SQLiteStore(self.state)

    def make_backend(self) -> Backend:
        return load_backend(self.backend.name, self.backend.settings)


def load_config(path: Optional[Path], overrides: dict[str, Any]) -> ServerConfig:
    """The YAML file (if any), then the flags that were given; errors name the key."""
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise InvalidRequest(f"{path}: expected a mapping at the top level")
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "backend":
            data.setdefault("backend", {})["name"] = value
        else:
            data[key] = value
    try:
        return ServerConfig(**data)
    except ValidationError as exc:
        raise InvalidRequest("; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())) from None
