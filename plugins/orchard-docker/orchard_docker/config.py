"""The ``docker`` backend's settings (``backend.settings`` in the server's config file).

Unknown keys are errors that name the key (``BackendConfig`` forbids extras); values that
cannot work are refused here, by field, before any container exists.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator

from orchard.agent.image_policy import DEFAULT_REGISTRIES
from orchard.backends.api import BackendConfig

SOCKET_PATH_ROOM = 42  # what a sandbox adds to state_dir: "/sandboxes/<16 hex>/run/agent.sock"
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the last one NUL


def default_state_dir() -> Path:
    """Root keeps control directories in /var/lib/orchard/docker, other users in ~/.local/state."""
    if os.geteuid() == 0:
        return Path("/var/lib/orchard/docker")
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "orchard" / "docker"


class DockerConfig(BackendConfig):
    docker_host: Optional[str] = Field(None, description="the engine's socket, unix:///PATH (default: DOCKER_HOST, "
                                       "else unix:///var/run/docker.sock); remote engines are refused in this version")
    state_dir: Path = Field(default_factory=default_state_dir,
                            description="host directory of the per-sandbox control directories (made 0700)")
    bundle_dir: Optional[Path] = Field(None, description="the agent bundle mounted read-only into every container "
                                       "(default: built once into state_dir/agent-bundle)")
    instance: str = Field("default", pattern=r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$",
                          description="this server's name in container labels and names: several can share an engine")
    registries: list[str] = Field(default_factory=lambda: list(DEFAULT_REGISTRIES),
                                  description="registries images may come from (host or host:port; '*': any)")
    pull: Literal["missing", "always", "never"] = Field("missing", description="when to pull a sandbox's image")
    network: str = Field("bridge", description="engine network of sandboxes created with block_network: false")
    user: Optional[str] = Field(None, description="run containers as this user (uid[:gid]); default: the image's")
    runtime: Optional[str] = Field(None, description="OCI runtime of the containers, e.g. runsc (gVisor)")
    ulimits: dict[str, int] = Field(default_factory=dict, description="e.g. {nofile: 20000}: rlimits (soft = hard); "
                                    "needed where the engine's defaults exceed what the daemon may set")
    default_pids: Optional[int] = Field(4096, ge=1, description="process limit of sandboxes that set none")
    agent_pids: int = Field(32, ge=8, description="processes and threads reserved for the agent on top of a "
                            "sandbox's pids limit")
    start_timeout: float = Field(120.0, gt=0, description="seconds a container's agent may take to answer")
    pull_timeout: float = Field(900.0, gt=0, description="seconds an image pull may take")
    api_timeout: float = Field(60.0, gt=0, description="seconds one engine API call may take")

    @field_validator("docker_host")
    @classmethod
    def _local_engine(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.startswith("unix://"):
            raise ValueError("only a local engine socket (unix:///PATH) is supported: the agent is reached through "
                             "a Unix socket in a bind-mounted directory, which a remote engine cannot share")
        return value

    @field_validator("state_dir")
    @classmethod
    def _short_enough(cls, value: Path) -> Path:
        value = value.expanduser().absolute()
        if len(str(value)) + SOCKET_PATH_ROOM > UNIX_PATH_MAX:
            raise ValueError(f"too long ({len(str(value))} characters) for the Unix socket paths below it: "
                             f"at most {UNIX_PATH_MAX - SOCKET_PATH_ROOM}")
        return value

    def engine_url(self) -> str:
        """The engine socket to use; a remote DOCKER_HOST is refused as the setting would be."""
        url = self.docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        if not url.startswith("unix://"):
            from orchard.errors import InvalidRequest

            raise InvalidRequest(f"docker_host: DOCKER_HOST={url} is a remote engine; this version of the docker "
                                 "backend needs a local one (unix:///PATH)")
        return url
