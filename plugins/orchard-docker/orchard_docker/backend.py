"""``docker``: one container per sandbox on a local Docker Engine or Podman socket, the exec
agent inside it (the agent bundle, mounted read-only, ``direct`` runtime).

The engine is only the control plane: create, inspect, list by label, remove. Commands and
files go to the container's agent over its Unix socket, whose host end lives in the
sandbox's control directory (``control.py``), so a container with ``network_mode: none``
is still reachable and no port is ever published. Containers carry labels (this server's
instance, the sandbox id, the limits it was made with), so a restarted backend finds them
again; a container that exited, was OOM-killed or removed is reported ``lost`` with why.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

from orchard.backends.agent_backed import AgentBackedBackend, AgentSite
from orchard.backends.api import AgentEndpoint
from orchard.backends.checks import Check
from orchard.client.http import ApiClient
from orchard.errors import (AgentUnreachable, BackendUnavailable, ImageRejected, InvalidRequest, SandboxConflict,
                            SandboxNotFound)
from orchard.models import Sandbox, SandboxSpec
from orchard.plugins import verify_image
from orchard.quantities import parse_memory
from orchard_docker import containers, control
from orchard_docker.config import DockerConfig
from orchard_docker.engine import Engine

log = logging.getLogger("orchard.backends.docker")

MIN_MEMORY = 64 << 20  # the agent (about 40 MB) runs inside the container's memory limit


class DockerBackend(AgentBackedBackend):
    name = "docker"
    config_model = DockerConfig

    def __init__(self, config: DockerConfig) -> None:
        super().__init__(config)
        self.config: DockerConfig = config
        self.engine = Engine(config.engine_url(), config.api_timeout, config.pull_timeout)
        self._agents: dict[str, ApiClient] = {}  # container name -> client of its agent
        self._made: dict[str, dict[str, Any]] = {}  # sandbox id -> limits its container was made with
        self._bundle_lock = asyncio.Lock()

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        if importlib.util.find_spec("docker") is None:
            return "the docker SDK is not installed (pip install docker)"
        return None

    @classmethod
    def doctor(cls, settings: dict[str, Any]) -> list[Check]:
        from orchard_docker.checks import docker_checks

        return docker_checks(settings)

    def start_timeout(self, spec: SandboxSpec) -> float:
        return spec.timeout or self.config.start_timeout

    # -- what a spec asks of the engine ------------------------------------------------------
    def reference(self, image: str) -> str:
        """The engine image a spec names, after the image policy (any plugin may refuse)."""
        if image in ("host", "direct") or image.startswith(("/", "dir://", ".")):
            raise ImageRejected(f"image {image!r}: the docker backend runs engine images (docker://REF or REF); "
                                "a directory can be imported first (docker import / podman import)")
        if "://" in image and not image.startswith("docker://"):
            raise ImageRejected(f"image {image!r}: only docker:// references are engine images")
        reference = containers.image_reference(image)
        reason = verify_image(f"docker://{reference}", {"registries": self.config.registries})
        if reason is not None:
            raise ImageRejected(f"image {image!r} refused: {reason}")
        return reference

    def pids_limit(self, spec: SandboxSpec) -> Optional[int]:
        pids = spec.pids or self.config.default_pids
        return pids + self.config.agent_pids if pids else None

    def check_limits(self, spec: SandboxSpec) -> None:
        if spec.memory and parse_memory(spec.memory) < MIN_MEMORY:
            raise InvalidRequest(f"memory: at least {MIN_MEMORY >> 20}Mi on the docker backend: the exec agent "
                                 "shares its container's memory (about 40 MB)")

    async def bundle(self) -> Path:
        """The agent bundle the containers mount, built once into the state directory."""
        bundle = self.config.bundle_dir or self.config.state_dir / "agent-bundle"
        async with self._bundle_lock:
            if not (bundle / "orchard-bundle.json").exists():
                if self.config.bundle_dir is not None:
                    raise BackendUnavailable(f"bundle_dir: {bundle} holds no agent bundle (orchard agent bundle "
                                             f"--out {bundle})")
                from orchard.bundle.build import build_bundle

                control.prepare_state_dir(self.config.state_dir)
                log.info("building the agent bundle into %s", bundle)
                await asyncio.to_thread(build_bundle, bundle, True)
        return bundle

    # -- placement: a container of its own ---------------------------------------------------
    async def place(self, spec: SandboxSpec) -> AgentSite:
        sandbox_id = str(spec.sandbox_id)
        reference = self.reference(spec.image)
        self.check_limits(spec)
        await self.engine.connect()
        bundle = await self.bundle()
        image = await self.engine.image(reference, self.config.pull)
        where, token = await asyncio.to_thread(control.make, self.config.state_dir, sandbox_id)
        name = containers.container_name(self.config.instance, sandbox_id)
        made = False
        try:
            await self._create_container(spec, reference, image, name, where, bundle)
            made = True
            await asyncio.to_thread(control.mark, where, sandbox_id)
            await self.engine.call("start", name)
            await self._wait_ready(name, where, token, sandbox_id)
            await asyncio.to_thread(control.seal, where, sandbox_id)
        except BaseException:
            if made:
                await self._remove(name)
            await asyncio.to_thread(control.remove, where)
            raise
        self._made[sandbox_id] = json.loads(json.dumps(containers.limits_of(spec)))
        return self._site(sandbox_id, name, where)

    async def _create_container(self, spec: SandboxSpec, reference: str, image: dict[str, Any], name: str,
                                where: control.ControlDir, bundle: Path) -> None:
        host = containers.host_options(spec, bundle=str(bundle), control=str(where.run), key=str(where.mounted_key),
                                       network=self.config.network, pids=self.pids_limit(spec),
                                       ulimits=self.config.ulimits, runtime=self.config.runtime)
        workdir = ((image.get("Config") or {}).get("WorkingDir") or "").strip()
        environment = {"ORCHARD_WORKDIR": workdir} if workdir else {}  # the direct runtime's default cwd
        try:
            host_config = await self.engine.call("create_host_config", **host)
            await self.engine.call("create_container", reference, name=name, entrypoint=containers.AGENT_ARGV[:1],
                                   command=containers.AGENT_ARGV[1:], labels=containers.labels(spec, self.config.instance),
                                   environment=environment, host_config=host_config, user=self.config.user)
        except SandboxConflict:
            raise SandboxConflict(f"sandbox {spec.sandbox_id!r}: container {name} already exists (made by another "
                                  f"server of instance {self.config.instance!r}?)") from None
        except (InvalidRequest, BackendUnavailable) as exc:
            if spec.disk and "storage" in str(exc).lower():
                raise InvalidRequest(f"disk: this engine's storage driver cannot limit a container's disk "
                                     f"({str(exc)[-300:]}); create the sandbox without disk") from None
            raise

    async def _wait_ready(self, name: str, where: control.ControlDir, token: str, sandbox_id: str) -> None:
        """Until the agent answers with its key (it has read it), within the start timeout;
        a container that stops meanwhile fails the create with its log's end."""
        api = ApiClient(f"unix://{where.container_socket}", token, timeout=5, retries=0)
        deadline = time.monotonic() + self.config.start_timeout
        try:
            while True:
                if where.container_socket.exists():
                    try:
                        await api.request("GET", "/sandboxes")
                        return
                    except AgentUnreachable:
                        pass
                attrs = await self.engine.call("inspect_container", name, missing_ok=True)
                reason = containers.lost_reason(attrs)
                if reason is not None:
                    logs = await self.engine.call("logs", name, missing_ok=True) if attrs else b""
                    tail = (logs or b"").decode(errors="replace")[-1500:]
                    raise BackendUnavailable(f"sandbox {sandbox_id!r}: {reason.replace('its container', 'container ' + name)}"
                                             f" before its agent answered: {tail}")
                if time.monotonic() > deadline:
                    raise BackendUnavailable(f"sandbox {sandbox_id!r}: the agent in container {name} did not answer "
                                             f"within {self.config.start_timeout:g} s (setting start_timeout)")
                await asyncio.sleep(0.05)
        finally:
            await api.close()

    # -- sites -------------------------------------------------------------------------------
    def _site(self, sandbox_id: str, name: str, where: control.ControlDir, lost: Optional[str] = None) -> AgentSite:
        token = where.token()
        if lost is None and token is None:
            lost = "its control directory (key and socket) is gone"
        if lost is not None:
            return AgentSite(name, None, None, placed={sandbox_id}, lost=lost)
        url = f"unix://{where.socket}"
        api = self._agents.get(name)
        if api is None:
            api = self._agents[name] = ApiClient(url, token, retries=2)
        return AgentSite(name, api, AgentEndpoint(url=url, token=token), placed={sandbox_id})

    def _from_container(self, attrs: dict[str, Any]) -> Optional[AgentSite]:
        found = (attrs.get("Config") or {}).get("Labels") or attrs.get("Labels") or {}
        sandbox_id = found.get(containers.SANDBOX_LABEL)
        if not sandbox_id or found.get(containers.INSTANCE_LABEL) != self.config.instance:
            return None
        self._made.setdefault(sandbox_id, containers.spec_of(found))
        name = containers.container_name(self.config.instance, sandbox_id)
        return self._site(sandbox_id, name, control.control_dir(self.config.state_dir, sandbox_id),
                          containers.lost_reason(attrs))

    async def _find(self, sandbox_id: str) -> Optional[AgentSite]:
        name = containers.container_name(self.config.instance, sandbox_id)
        attrs = await self.engine.call("inspect_container", name, missing_ok=True)
        if attrs is not None:
            return self._from_container(attrs)
        where = control.control_dir(self.config.state_dir, sandbox_id)
        if where.sandbox_id() == sandbox_id:
            return self._site(sandbox_id, name, where, "its container was removed")
        return None

    async def placed(self, sandbox_id: str) -> Optional[AgentSite]:
        return await self._find(sandbox_id)

    async def locate(self, sandbox_id: str) -> AgentSite:
        site = await self._find(sandbox_id)
        if site is None:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return site

    async def sites(self) -> list[AgentSite]:
        summaries = await self.engine.call("containers", all=True, filters=containers.selector(self.config.instance))
        found: list[AgentSite] = []
        seen: set[str] = set()
        for summary in summaries:
            attrs = {**summary, "State": {"Status": "running"}}
            if summary.get("State") != "running":  # why it stopped (OOM) is only in the inspect document
                attrs = await self.engine.call("inspect_container", summary["Id"], missing_ok=True) or \
                    {**summary, "State": {"Status": "removed"}}
            site = self._from_container(attrs)
            if site is not None:
                found.append(site)
                seen |= site.placed or set()
        for where in await asyncio.to_thread(lambda: list(control.existing(self.config.state_dir))):
            sandbox_id = where.sandbox_id()
            if sandbox_id and sandbox_id not in seen:
                name = containers.container_name(self.config.instance, sandbox_id)
                found.append(self._site(sandbox_id, name, where, "its container was removed"))
        return found

    async def recheck(self, site: AgentSite) -> AgentSite:
        (sandbox_id,) = site.placed or {""}
        return await self._find(sandbox_id) or AgentSite(site.key, None, None, placed=site.placed,
                                                         lost="its container was removed")

    async def release(self, site: AgentSite, sandbox_id: str, *, failed: bool = False) -> None:
        await self._remove(site.key)
        await asyncio.to_thread(control.remove, control.control_dir(self.config.state_dir, sandbox_id))
        self._made.pop(sandbox_id, None)

    async def _remove(self, name: str) -> None:
        api = self._agents.pop(name, None)
        if api is not None:
            await api.close()
        await self.engine.call("remove_container", name, force=True, v=True, missing_ok=True)

    def agent_spec(self, spec: SandboxSpec) -> SandboxSpec:
        """The container is the sandbox: its agent runs commands in place, limits are the
        container's. A repeated create must ask for what the container was made with."""
        made = self._made.get(str(spec.sandbox_id))
        asked = json.loads(json.dumps(containers.limits_of(spec)))
        if made is not None and made != asked:
            differs = sorted(key for key in asked if asked.get(key) != made.get(key))
            raise SandboxConflict(f"sandbox {spec.sandbox_id!r} exists with other settings ({', '.join(differs)})")
        return spec.model_copy(update={"image": "host", "memory": None, "cpu": None, "disk": None, "pids": None})

    def answered(self, body: dict[str, Any], spec: Optional[SandboxSpec] = None) -> Sandbox:
        """The agent in a container sees image 'host' and no limits: report what the container
        was made with."""
        sandbox = super().answered(body, spec)
        made = self._made.get(sandbox.sandbox_id)
        if made:
            sandbox = sandbox.model_copy(update={key: made[key] for key in containers.LIMIT_FIELDS if key in made})
        return sandbox

    async def maintain(self) -> None:
        """Remove control directories of creations that crashed before their container existed."""
        for entry in await asyncio.to_thread(lambda: list(control.sandboxes_dir(self.config.state_dir).glob("*"))):
            where = control.ControlDir(entry)
            try:
                stale = not where.marker.exists() and time.time() - entry.stat().st_mtime > 2 * self.config.start_timeout
            except OSError:
                continue
            if stale:
                await asyncio.to_thread(control.remove, where)

    async def resources(self) -> dict[str, Any]:
        summaries = await self.engine.call("containers", all=True, filters=containers.selector(self.config.instance))
        return {"containers": len(summaries), "engine": self.engine.url, "instance": self.config.instance}

    async def close(self) -> None:
        for api in self._agents.values():
            await api.close()
        self._agents.clear()
        await self.engine.close()
