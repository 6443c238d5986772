"""Settings of one exec agent, and the layout of its state directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, DirectoryPath, Field, FilePath, ValidationInfo, field_validator

from orchard.agent.egress.ranges import parse_networks
from orchard.agent.host_ids import DEFAULT_HOST_UID
from orchard.agent.image_policy import DEFAULT_REGISTRIES
from orchard.quantities import parse_bytes, parse_cpu


def default_state_dir() -> Path:
    """Root keeps state in /var/lib/orchard (sandbox roots must be reachable by the
    unprivileged sandbox uid, which /root is not); other users in ~/.local/state."""
    if os.environ.get("ORCHARD_STATE_DIR"):
        return Path(os.environ["ORCHARD_STATE_DIR"])
    if os.geteuid() == 0:
        return Path("/var/lib/orchard")
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "orchard"


class AgentSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state_dir: Path = Field(default_factory=default_state_dir)
    runtime: str = Field("bwrap", description="isolation runtime: bwrap, direct, or a plugin's")
    sandbox_uid: int = Field(1000, ge=0, description="uid of commands inside the sandbox")
    sandbox_gid: int = Field(1000, ge=0)
    host_uid: int = Field(DEFAULT_HOST_UID, gt=0, lt=2**31, description="first of the unprivileged host uids "
                          "sandboxes map to (root agents): it owns unpacked images, each sandbox gets one of the "
                          "next ones")
    host_gid: int = Field(DEFAULT_HOST_UID, gt=0, lt=2**31)
    host_id_count: int = Field(65536, ge=1, description="how many host uids/gids from host_uid/host_gid sandboxes "
                                                        "may use (none may belong to an account of this machine)")
    host_id_search: int = Field(64, ge=1, description="when the range is held by another agent on this machine (or "
                                                      "clashes with an account), try this many next ranges")
    default_memory: Optional[str] = Field("4Gi", description="memory limit when a sandbox sets none")
    default_pids: Optional[int] = Field(4096, description="process limit when a sandbox sets none")
    sandbox_socket_memory: Optional[str] = Field("64Mi", description="TCP buffers the sockets of one sandbox may "
                                                 "hold (cgroup v1, which leaves them out of its memory limit: a "
                                                 "blocked sandbox held 1.87 GiB of the host's 2.2 GiB tcp_mem); "
                                                 "cgroup v2 counts them in its memory limit")
    raise_file_max: bool = Field(True, description="root agents lift fs.file-max at start, as systemd does at "
                                 "boot (open files are charged to the opener's memory cgroup, so each sandbox's "
                                 "memory limit bounds its files); off: the host's limit stays, and one sandbox may "
                                 "exhaust it")
    sandbox_open_files: int = Field(4096, ge=64, le=1 << 20, description="open files one process of a sandbox "
                                    "may hold (its hard limit; the soft one is 1,024 or this, if less); sandboxes "
                                    "inherited the agent's own, raised to the host's hard limit")
    total_pids: Optional[int] = Field(None, ge=16, description="processes of all this agent's sandboxes together "
                                      "(the pids limit of its own cgroup); null: three quarters of the kernel's "
                                      "pid_max, so sandboxes at their default limit cannot take the host's pid space")
    default_cpu: Optional[str] = Field(None, description="CPU quota when a sandbox sets none (\"2\", \"500m\"); "
                                       "null: none, each sandbox's own CPU group at the default weight, so busy "
                                       "sandboxes share the CPUs equally")
    default_disk: Optional[str] = Field("10Gi", description="writable-layer quota when a sandbox sets none")
    max_output_bytes: int = Field(1 << 20, ge=1024, description="kept per stream: half head, half tail")
    job_retention_seconds: float = Field(3600, gt=0, description="how long finished jobs stay retrievable")
    job_retention_bytes: int = Field(512 << 20, gt=0, description="captured output kept over all finished jobs")
    ready_timeout: float = Field(60, gt=0)
    max_sandboxes: int = Field(5000, gt=0)
    max_snapshots: int = Field(1000, gt=0, description="snapshots kept at once (each holds its sandbox's changes)")
    max_snapshot_bytes: str = Field("8Gi", description="bytes all snapshots may hold together (their layers stay in "
                                    "memory, outside every sandbox's memory limit); a snapshot that would pass it is "
                                    "refused")
    insecure_registries: list[str] = Field(default_factory=lambda: ["localhost", "127.0.0.1"],
                                           description="allowed registries reached without TLS")
    registries: list[str] = Field(default_factory=lambda: list(DEFAULT_REGISTRIES),
                                  description="registries docker:// images may come from (host or host:port; '*': any)")
    image_digests: list[str] = Field(default_factory=list,
                                     description="when set, docker:// images must be pinned by one of these digests "
                                     "('IMAGE@sha256:...'); a tag alone is refused, since a tag can be moved")
    signature_policy: Optional[FilePath] = Field(
        None, description="a containers-policy.json(5) file skopeo enforces on every docker:// pull, e.g. signedBy "
        "GPG keys or sigstoreSigned keys per registry; null: skopeo's default (/etc/containers/policy.json). It, the "
        "keys it names and registries_d must be readable by the agent's unprivileged image owner")
    registries_d: Optional[DirectoryPath] = Field(
        None, description="a containers-registries.d(5) directory: where skopeo finds the signatures "
        "signature_policy asks for (a lookaside store)")
    image_dirs: list[str] = Field(default_factory=list,
                                  description="directories that directory images may come from (besides STATE/rootfs)")
    protected_dirs: list[str] = Field(default_factory=list,
                                      description="never part of a directory image (besides the agent's own state)")
    host_paths: list[str] = Field(default_factory=list, description="extra read-only host paths for the host image")
    max_body_bytes: int = Field(96 << 20, ge=1 << 20, description="largest JSON request body (413 above)")
    max_upload_bytes: Optional[int] = Field(None, ge=1, description="largest raw upload (default: the sandbox's "
                                                                    "disk quota decides)")
    max_inline_file_bytes: int = Field(64 << 20, gt=0,
                                       description="largest file the JSON (base64) file routes move; raw routes have no cap")
    cgroup_sweep_seconds: float = Field(30.0, gt=0, description="how often the cgroups of deleted sandboxes whose "
                                        "killed processes were slow to leave are emptied and removed (their host "
                                        "ids stay taken until then)")
    idle_exit_seconds: Optional[float] = Field(900.0, gt=0, description="exit after this long with no sandbox and "
                                               "no call (the local backend starts it again on demand); null: never")
    max_file_calls: int = Field(256, ge=1, description="file calls in flight over all sandboxes (more wait); one "
                                "sandbox holds at most a quarter of them (and 16)")
    file_call_stall_seconds: float = Field(30.0, gt=0, description="a file call whose helper makes no progress for "
                                           "this long is killed and fails (one found stopped inside its sandbox "
                                           "at once)")
    max_connections: int = Field(4096, ge=16, description="connections the agent serves at once (503 above)")
    max_list_entries: int = Field(10000, gt=0, description="most directory entries one files/list page returns")
    sandbox_ptys: int = Field(64, ge=1, le=4096, description="terminals (pseudo-terminal devices) one sandbox may "
                              "hold open, its own processes' included: a cap on its devpts, since the kernel's pool "
                              "(kernel.pty.max) is shared by the whole host")
    max_ptys_per_sandbox: int = Field(16, ge=1, description="interactive processes (WS .../exec/pty) one sandbox may "
                                      "have open at once; more are refused with an error frame")
    max_ptys: int = Field(1024, ge=1, description="interactive processes over all sandboxes of this agent")
    pty_idle_timeout_seconds: float = Field(3600, gt=0, description="an interactive process with no input and no "
                                            "output for this long is killed")
    pty_max_seconds: float = Field(86400, gt=0, description="an interactive process is killed after this long")
    pty_detach_grace_seconds: float = Field(30, ge=0, description="after its connection drops, an interactive "
                                            "process waits this long for the client to reattach, then is killed")
    spawner: bool = Field(True, description="bwrap sandboxes: the holder forks commands itself (no orchard-enter "
                          "exec and namespace entry per command; see orchard/agent/spawner.py); commands fall back to "
                          "orchard-enter whenever the spawner does not answer")
    prestart_shell: bool = Field(True, description="with the spawner, where the sandbox's shell is bash: the next "
                                 "command's bash is started ahead and waits for it (bash's start, about 1 ms, off the "
                                 "command's path). It runs the command through eval: a syntax error reads 'bash: eval: "
                                 "line N:' instead of 'bash: -c: line N:'; off runs each command as a fresh bash -c")
    network_egress: Literal["auto", "nat", "slirp", "none", "host"] = Field(
        "auto", description="how sandboxes with network (block_network: false) get out of their own network "
        "namespace: nat (root agents: a veth pair, routed and masqueraded, private, link-local and the host's own "
        "networks refused), slirp (slirp4netns, for agents that are not root: the host's loopback refused, its other "
        "networks not), none (such sandboxes are refused), host (the host's own network namespace: the sandbox "
        "reaches every loopback service of the host; never the default); auto: nat, else slirp, else none")
    network_pool: str = Field("198.18.0.0/15", description="nat: the IPv4 range sandboxes take their addresses "
                              "from (RFC 2544's benchmarking range; change it where the host uses it)")
    network_allow: list[str] = Field(default_factory=list, description="nat: IPv4 addresses or networks sandboxes "
                                     "may reach although they are private, link-local or the host's (a package "
                                     "mirror on the LAN, say)")
    network_max_flows: int = Field(2048, ge=16, le=1 << 20, description="nat: connections (tracked flows, UDP "
                                   "ones too) one sandbox may have at once; more are refused. The host's conntrack "
                                   "table and the source ports behind its address are shared by every sandbox")
    network_dns: Optional[list[str]] = Field(None, description="nat: the name servers sandboxes with network use "
                                             "(and may reach on port 53); null: the host's resolv.conf, loopback "
                                             "ones left out")
    cgroups_below_own: bool = Field(False, description="make sandbox cgroups below the agent's own (cgroup v1), so "
                                    "limits on the agent's cgroup, such as a Slurm job's, bound its sandboxes too")

    @field_validator("network_pool")
    @classmethod
    def _pool(cls, value: str) -> str:
        (pool,) = parse_networks([value], "network_pool")
        if pool.num_addresses < 4:
            raise ValueError("network_pool: needs at least 4 addresses")
        return str(pool)

    @field_validator("network_allow", "network_dns")
    @classmethod
    def _networks(cls, value: Optional[list[str]], info: ValidationInfo) -> Optional[list[str]]:
        if value is not None:
            parse_networks(value, info.field_name or "network")
        return value

    @field_validator("default_cpu")
    @classmethod
    def _cpu(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_cpu(value)
        return value

    def sandbox_pids_total(self) -> int:
        """``total_pids``, or three quarters of this kernel's pid_max."""
        if self.total_pids is not None:
            return self.total_pids
        try:
            return int(Path("/proc/sys/kernel/pid_max").read_text()) * 3 // 4
        except (OSError, ValueError):
            return 24576

    @field_validator("max_snapshot_bytes", "sandbox_socket_memory")
    @classmethod
    def _size(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        if value is not None:
            parse_bytes(value, info.field_name or "size")
        return value

    @property
    def agent_dir(self) -> Path:
        return self.state_dir / "agent"

    @property
    def sandboxes_dir(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def share_dir(self) -> Path:
        return self.state_dir / "share"

    @property
    def images_dir(self) -> Path:
        return self.state_dir / "images"

    @property
    def rootfs_dir(self) -> Path:
        return self.state_dir / "rootfs"

    def image_policy(self) -> dict[str, Any]:
        """What the ``orchard_verify_image`` hooks are given."""
        return {"registries": self.registries, "insecure_registries": self.insecure_registries,
                "image_digests": self.image_digests,
                "signature_policy": str(self.signature_policy) if self.signature_policy else None,
                "registries_d": str(self.registries_d) if self.registries_d else None,
                "image_dirs": [str(self.rootfs_dir), *self.image_dirs],
                "protected_dirs": [str(self.agent_dir), str(self.sandboxes_dir), str(self.images_dir),
                                   str(self.share_dir), *self.protected_dirs]}

    def make_dirs(self) -> None:
        for path, mode in [(self.state_dir, 0o711), (self.agent_dir, 0o700),
                           (self.sandboxes_dir, 0o711), (self.share_dir, 0o755), (self.images_dir, 0o711),
                           (self.rootfs_dir, 0o755)]:
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, mode)
