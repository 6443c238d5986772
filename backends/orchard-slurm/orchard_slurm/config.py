"""What a site sets for the Slurm backend (``backend.settings`` in orchard.yaml)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from orchard.backends.api import BackendConfig
from orchard.agent.image_policy import DEFAULT_REGISTRIES
from orchard.agent.reachable import unreachable_reason
from orchard.agent.host_ids import DEFAULT_HOST_UID, clashing_accounts
from orchard.agent.settings import default_state_dir


PER_JOB_CONTAINERS = ("bwrap", "charliecloud", "apptainer")


PODMAN_ID_SPAN = 65536  # ids a Podman container's user namespace maps


class SlurmConfig(BackendConfig):
    shared_dir: Path = Field(default_factory=lambda: default_state_dir() / "slurm",
                             description="a directory the service and the compute nodes both see (pilot addresses, "
                                         "tokens, submitit's files)")
    mode: Literal["pilot", "per-job"] = Field("pilot", description="pilot: pilot jobs host many sandboxes; "
                                                                   "per-job: one Slurm job per sandbox, the agent "
                                                                   "inside its container")
    bundle_dir: Optional[Path] = Field(None, description="per-job mode: the agent bundle the containers run "
                                                         "(default: built once into shared_dir/agent-bundle)")
    image_cache_dir: Optional[Path] = Field(None, description="per-job mode: where docker:// images are unpacked "
                                                              "once for every job (default: shared_dir/image-cache)")
    insecure_registries: list[str] = Field(default_factory=lambda: ["localhost", "127.0.0.1"],
                                           description="per-job mode: registries pulled from without TLS")
    registries: list[str] = Field(default_factory=lambda: list(DEFAULT_REGISTRIES),
                                  description="registries docker:// images may come from (host or host:port; '*': any)")
    image_dirs: list[Path] = Field(default_factory=list, description="directories that directory images may come "
                                                                    "from (besides shared_dir/images)")
    image_digests: list[str] = Field(default_factory=list, description="when set, docker:// images must be pinned "
                                     "by one of these digests (as the agent's setting)")
    signature_policy: Optional[Path] = Field(None, description="a containers-policy.json skopeo enforces on every "
                                             "docker:// pull, on the nodes (as the agent's setting; the path must be "
                                             "there); the apptainer runtime then refuses images it would pull itself")
    registries_d: Optional[Path] = Field(None, description="where skopeo finds signatures (a containers-registries.d "
                                         "directory on the nodes)")
    host_uid: int = Field(DEFAULT_HOST_UID + 10_000_000, gt=0, lt=2**31,
                          description="first host uid/gid of the sandboxes' range (root jobs): each sandbox gets an "
                                      "id of its own, claimed on its node")
    host_gid: int = Field(DEFAULT_HOST_UID + 10_000_000, gt=0, lt=2**31)
    host_id_count: int = Field(65536, ge=2, description="how many ids from host_uid/host_gid; ranges holding an "
                                                        "account are refused here and skipped on the nodes (a "
                                                        "Podman pilot claims 65,536 of them on its node)")
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_limit_minutes: int = Field(60, gt=0, description="walltime of each pilot job")
    max_pilots: int = Field(4, gt=0, description="pilot jobs at most (the pool grows up to this)")
    min_pilots: int = Field(0, ge=0, description="pilots kept up even when idle, submitted together as one job "
                                                "array on first use (so first sandboxes skip the pilot start)")
    sandboxes_per_pilot: int = Field(32, gt=0, description="also the cap that keeps one fork bomb from taking "
                                                          "a pilot down where cgroups are not delegated")
    cpus_per_pilot: int = Field(1, gt=0)
    mem_per_pilot_gb: float = Field(2.0, gt=0)
    gpus_per_pilot: int = Field(0, ge=0)
    runtime: str = Field("bwrap", description="pilot mode: the agents' isolation runtime; per-job mode: the "
                                              "container (bwrap, charliecloud or apptainer)")
    agent_host: Optional[str] = Field(None, description="address the agents listen on and report "
                                                        "(default: the compute node's hostname)")
    pilot_start_timeout: float = Field(120.0, gt=0, description="seconds to wait for a pilot's agent")
    min_remaining_minutes: float = Field(5.0, ge=0, description="no new sandbox on a pilot with less walltime "
                                                                "(counted before the stop margin)")
    stop_margin_seconds: int = Field(120, ge=30, description="Slurm warns a pilot (SIGUSR2) this long before its "
                                                             "time limit; the pilot then deletes its sandboxes and "
                                                             "stops (Slurm may signal up to 60 s early)")
    pilot_idle_seconds: float = Field(300.0, ge=0, description="cancel a pilot that hosted nothing this long")
    job_name: str = Field("orchard-pilot", description="Slurm job name of the pilots; with the comment "
                                                       "naming the shared directory, how orphans are found")
    slurm_poll_seconds: float = Field(2.0, gt=0, description="how stale a pilot's Slurm state may be")

    def host_id_settings(self) -> tuple[int, int, int, int]:
        """(first uid, first gid, ids per job, ranges to search): each job claims a free block
        on its node (a pilot one id per sandbox plus the first, which owns its images; a
        per-job sandbox one id after the range's first, which owns the shared image cache),
        so no two jobs on a node, of this service or another, share a sandbox uid."""
        if self.mode == "per-job":
            return self.host_uid + 1, self.host_gid + 1, 1, self.host_id_count - 1
        return self.host_uid, self.host_gid, self.pilot_id_block, self.host_id_count // self.pilot_id_block

    @property
    def pilot_id_block(self) -> int:
        """Host ids one pilot claims on its node: one per sandbox plus the first, or, for
        Podman, the 65,536 its containers' user namespace maps (``--uidmap``), so no other
        job's sandbox uid falls inside a Podman pilot's range."""
        return PODMAN_ID_SPAN if self.runtime == "podman" else self.sandboxes_per_pilot + 1

    def sandbox_memory_share(self) -> int:
        """Bytes of the pilot job's memory each of its sandboxes may use: the job's memory,
        less a reserve for the agent, split evenly. Sandbox cgroups sit inside the job's, so
        limits above this share would let one sandbox run the whole pilot (and its
        neighbours) out of memory."""
        reserve = 256 << 20
        total = int(self.mem_per_pilot_gb * (1 << 30))
        return max(16 << 20, (total - reserve) // self.sandboxes_per_pilot)

    def image_policy(self) -> dict[str, Any]:
        """The image policy of this backend's agents (see orchard.agent.image_policy)."""
        return {"registries": self.registries, "insecure_registries": self.insecure_registries,
                "image_digests": self.image_digests,
                "signature_policy": str(self.signature_policy) if self.signature_policy else None,
                "registries_d": str(self.registries_d) if self.registries_d else None,
                "image_dirs": [str(self.shared_dir / "images"), *map(str, self.image_dirs)],
                "protected_dirs": [str(self.shared_dir / "pilots")]}

    @model_validator(mode="after")
    def _known_runtime(self) -> "SlurmConfig":
        if os.geteuid() == 0 and (self.mode == "per-job" or self.runtime != "direct"):
            reason = unreachable_reason(self.shared_dir, self.host_uid, self.host_gid, setting="shared_dir")
            if reason:
                raise ValueError(reason)
            clashes = clashing_accounts(self.host_uid, self.host_gid, self.host_id_count)
            if clashes:
                raise ValueError(f"host_uid: the sandboxes' ids {self.host_uid}..{self.host_uid + self.host_id_count - 1}"
                                 f" include {', '.join(clashes[:5])}; choose a range no account uses")
        if self.mode == "pilot" and self.host_id_count < self.pilot_id_block:
            raise ValueError(f"host_id_count ({self.host_id_count}) is less than a pilot's block of "
                             f"{self.pilot_id_block} ids ({'what a Podman container maps' if self.runtime == 'podman' else 'one per sandbox and one for its images'})")
        if self.min_pilots > self.max_pilots:
            raise ValueError(f"min_pilots ({self.min_pilots}) is more than max_pilots ({self.max_pilots})")
        if self.mode == "per-job":
            if self.runtime not in PER_JOB_CONTAINERS:
                raise ValueError(f"runtime: per-job mode runs {', '.join(PER_JOB_CONTAINERS)} containers, "
                                 f"not {self.runtime!r}")
            return self
        from orchard.plugins import collect

        runtimes = collect("orchard_register_runtimes")
        if self.runtime not in runtimes:
            raise ValueError(f"runtime: unknown runtime {self.runtime!r}; installed: {', '.join(sorted(runtimes))}")
        return self
