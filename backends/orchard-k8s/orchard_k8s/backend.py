"""``k8s``: one pod per sandbox, the exec agent injected into the task image.

The API server sees three calls per sandbox life cycle (create the pod, create its key's
Secret, owned by the pod; delete the pod, which takes the Secret with it) plus one watch
shared by all sandboxes; exec and file calls go straight to the pod's IP. Creations are
bounded (``create_concurrency``) and retried with backoff on 429 and 5xx answers.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from typing import Any, Callable, Optional

from orchard.backends.agent_backed import AgentBackedBackend, AgentSite
from orchard.backends.api import AgentEndpoint
from orchard.backends.checks import Check
from orchard.client.http import ApiClient
from orchard.errors import BackendUnavailable, ImageRejected, InvalidRequest, SandboxConflict, SandboxNotFound
from orchard.models import Sandbox, SandboxSpec
from orchard.quantities import parse_memory
from orchard_k8s import manifests, pods
from orchard_k8s.checks import k8s_checks
from orchard_k8s.config import K8sConfig


MIN_MEMORY = 64 << 20  # the agent (about 40 MB) runs inside the pod's memory limit


class KubernetesBackend(AgentBackedBackend):
    name = "k8s"
    config_model = K8sConfig

    def __init__(self, config: K8sConfig) -> None:
        super().__init__(config)
        self.config: K8sConfig = config
        self.api_calls = 0  # requests made to the API server (the watch's own excluded)
        self._core: Any = None
        self._watch: Any = None
        self._started = asyncio.Lock()
        self._slots = asyncio.Semaphore(config.create_concurrency)
        self._agents: dict[str, ApiClient] = {}  # pod name -> client of its agent
        self._tokens: dict[str, str] = {}  # pod name -> its agent's key
        self._deleted: set[str] = set()  # pods we deleted that the watch still shows

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        try:
            import kubernetes  # noqa: F401  (only whether it imports)
        except ImportError:
            return "the kubernetes client is not installed (pip install kubernetes)"
        return None

    @classmethod
    def doctor(cls, settings: dict[str, Any]) -> list[Check]:
        return k8s_checks(settings)

    def start_timeout(self, spec: SandboxSpec) -> float:
        return spec.timeout or self.config.start_timeout

    # -- the API server ------------------------------------------------------------------
    async def _start(self) -> None:
        """Connect, make the namespace's network policies (once), and start the shared watch."""
        if self._watch is not None:
            return
        async with self._started:
            if self._watch is not None:
                return
            from kubernetes import client, config as kube_config

            from orchard_k8s.watch import PodWatch

            if self.config.kubeconfig:
                api = await asyncio.to_thread(kube_config.new_client_from_config, self.config.kubeconfig,
                                              self.config.context)
            else:
                kube_config.load_incluster_config()
                api = client.ApiClient()
            self._core = client.CoreV1Api(api)
            networking = client.NetworkingV1Api(api)
            for policy in manifests.network_policies(self.config):
                await self._call(networking.create_namespaced_network_policy, self.config.namespace, policy,
                                 exists_ok=True)
            watcher = PodWatch(self._core, self.config.namespace, manifests.selector(self.config),
                               asyncio.get_running_loop())
            watcher.start()
            await asyncio.wait_for(watcher.synced.wait(), 60)
            self._watch = watcher

    async def _call(self, method: Callable[..., Any], *args: Any, exists_ok: bool = False,
                    missing_ok: bool = False, **kwargs: Any) -> Any:
        """One API request, retried with backoff when the server is busy (429), failing (5xx) or
        its connection fails (no answer at all)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        for attempt in range(self.config.api_retries + 1):
            self.api_calls += 1
            try:
                return await asyncio.to_thread(method, *args, **kwargs)
            except HTTPError as exc:  # the connection failed (a pooled one the server closed): no answer
                # Sent again: a create that did land answers 409, which every caller here handles.
                if attempt == self.config.api_retries:
                    raise BackendUnavailable(f"Kubernetes API unreachable: {exc}", retryable=True) from None
                await asyncio.sleep(min(5.0, 0.1 * 2 ** attempt))
            except ApiException as exc:
                if exc.status == 409 and exists_ok or exc.status == 404 and missing_ok:
                    return None
                if exc.status == 409:
                    raise SandboxConflict(f"already exists: {exc.reason}") from None
                if exc.status in (400, 422):
                    raise InvalidRequest(f"the API server refused the pod: {exc.body or exc.reason}") from None
                if exc.status != 429 and exc.status < 500 or attempt == self.config.api_retries:
                    raise BackendUnavailable(f"Kubernetes API: {exc.status} {exc.reason}") from None
                retry_after = (exc.headers or {}).get("Retry-After")
                await asyncio.sleep(float(retry_after) if retry_after and retry_after.isdigit()
                                    else min(5.0, 0.1 * 2 ** attempt))
        raise AssertionError("unreachable")

    # -- sites ---------------------------------------------------------------------------
    async def _token(self, name: str, sandbox_id: str) -> Optional[str]:
        """The agent's key: known since we made it, or read from its Secret (after a restart);
        None if the Secret is gone (its pod is being deleted)."""
        if name not in self._tokens:
            secret = await self._call(self._core.read_namespaced_secret, manifests.secret_name(sandbox_id),
                                      self.config.namespace, missing_ok=True)
            if secret is None:
                return None
            self._tokens[name] = base64.b64decode(secret.data["token"]).decode()
        return self._tokens[name]

    async def _site(self, sandbox_id: str, pod: Optional[dict[str, Any]]) -> AgentSite:
        name = manifests.pod_name(sandbox_id)
        lost = pods.lost_reason(pod)
        if lost is not None or pod is None:
            return AgentSite(name, None, None, placed={sandbox_id}, lost=lost)
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            return AgentSite(name, None, None, placed={sandbox_id})
        url = f"http://{ip}:{self.config.agent_port}"
        token = await self._token(name, sandbox_id)
        if token is None:
            return AgentSite(name, None, None, placed={sandbox_id}, lost="its pod's key Secret is gone")
        api = self._agents.get(name)
        if api is None or api.url != url:
            api = self._agents[name] = ApiClient(url, token, retries=2)
        return AgentSite(name, api, AgentEndpoint(url=url, token=token), placed={sandbox_id})

    # -- placement: a pod of its own -----------------------------------------------------
    async def place(self, spec: SandboxSpec) -> AgentSite:
        if spec.memory and parse_memory(spec.memory) < MIN_MEMORY:
            raise InvalidRequest(f"memory: at least {MIN_MEMORY >> 20}Mi on the k8s backend: the exec agent "
                                 "shares its pod's memory (about 40 MB)")
        if spec.pids:
            raise InvalidRequest("pids: a pod's process limit is the node's (kubelet podPidsLimit); "
                                 "per-sandbox pids limits are not applied by the k8s backend")
        await self._start()
        return await self._place(spec, attempts=3)

    async def _place(self, spec: SandboxSpec, attempts: int) -> AgentSite:
        sandbox_id = str(spec.sandbox_id)
        name = manifests.pod_name(sandbox_id)
        if name in self._deleted:  # the same id again, before the watch saw the old pod go
            await self._wait(name, lambda pod: pod is None, spec, "an earlier pod of this id to go")
        token, key = secrets.token_urlsafe(32), None
        async with self._slots:
            try:
                made = await self._call(self._core.create_namespaced_pod, self.config.namespace,
                                        manifests.pod_manifest(spec, self.config))
            except SandboxConflict:  # another server made it and our watch has yet to show it
                made = None
            if made is not None:
                owner = {"name": made.metadata.name, "uid": made.metadata.uid}
                try:
                    key = await self._key_secret(sandbox_id, token, owner)
                except BaseException:  # a pod without its key can never start: not left behind
                    await self._delete(name)
                    raise
                if key is None:  # a stale key was there, which our pod may have read: start over
                    await self._delete(name)
                    if attempts <= 1:
                        raise BackendUnavailable(f"sandbox {sandbox_id!r}: its key Secret kept being made by "
                                                 "another server")
                else:  # never None: a pod of this name made later (by another replica) would read as key-less
                    self._tokens[name] = key
        if made is None:
            await self._wait(name, lambda pod: pod is not None, spec, "the pod another server made to show")
            return await self.placed(sandbox_id) or await self._place(spec, attempts)  # adopted, or deleted
        if key is None:
            return await self._place(spec, attempts - 1)
        return await self._settled(sandbox_id, spec)

    async def _wait(self, name: str, done: Callable[[Optional[dict[str, Any]]], bool], spec: SandboxSpec,
                    what: str) -> None:
        try:
            await self._watch.wait_for(name, done, self.start_timeout(spec))
        except asyncio.TimeoutError:
            raise BackendUnavailable(f"sandbox {str(spec.sandbox_id)!r}: waited in vain for {what}") from None

    async def _key_secret(self, sandbox_id: str, token: str, owner: dict[str, str]) -> Optional[str]:
        """Make the key Secret of the pod ``owner``: its token, or None where a Secret of that
        name owned by another pod was there. That one (a replica died between its two calls and
        its request landed late, or the garbage collector has yet to remove it) is deleted, by
        uid, never trusted; the pod may have started with its token, so the caller starts over.
        Ours already there (a retried request that had landed) is kept, with its token."""
        from kubernetes.client import V1DeleteOptions, V1Preconditions

        secret_name, namespace = manifests.secret_name(sandbox_id), self.config.namespace
        made = await self._call(self._core.create_namespaced_secret, namespace,
                                manifests.secret_manifest(sandbox_id, token, self.config, owner), exists_ok=True)
        if made is not None:
            return token
        there = await self._call(self._core.read_namespaced_secret, secret_name, namespace, missing_ok=True)
        if there is not None and any(ref.uid == owner["uid"] for ref in there.metadata.owner_references or []):
            return base64.b64decode(there.data["token"]).decode()
        if there is not None:
            await self._call(self._core.delete_namespaced_secret, secret_name, namespace, missing_ok=True,
                             exists_ok=True, body=V1DeleteOptions(preconditions=V1Preconditions(uid=there.metadata.uid)))
        return None

    async def _settled(self, sandbox_id: str, spec: SandboxSpec) -> AgentSite:
        """The pod's site once it is ready; a pod that fails to start is deleted, and why raised."""
        name = manifests.pod_name(sandbox_id)
        seen = False

        def settled(pod: Optional[dict[str, Any]]) -> bool:
            """Ready, failing, or gone after the watch saw it (not yet seen is not gone)."""
            nonlocal seen
            if pod is None:
                return seen
            seen = True
            return pods.is_ready(pod) or pods.start_failure(pod) is not None

        try:
            pod = await self._watch.wait_for(name, settled, self.start_timeout(spec))
        except asyncio.TimeoutError:
            why = pods.unschedulable(self._watch.pods.get(name) or {}) or "not ready in time"
            await self._delete(name)
            raise BackendUnavailable(f"pod {name} for sandbox {sandbox_id!r}: {why}") from None
        failure = pods.start_failure(pod) if pod is not None else "its pod was deleted while starting"
        if failure is not None:
            await self._delete(name)
            if "Image" in failure.split(":")[0]:
                raise ImageRejected(f"image {spec.image!r}: {failure}")
            raise BackendUnavailable(f"pod {name} for sandbox {sandbox_id!r} did not start: {failure}")
        return await self._site(sandbox_id, pod)

    async def placed(self, sandbox_id: str) -> Optional[AgentSite]:
        """The pod of a create asked again. One that a server made but did not see ready (it was
        restarted, or another replica died meanwhile) is waited for; one whose key Secret was
        never made (its creator died between the two calls) can never start: it is deleted, and
        the sandbox placed afresh."""
        await self._start()
        name = manifests.pod_name(sandbox_id)
        pod = self._watch.pods.get(name)
        if pod is None or name in self._deleted:
            return None
        if pods.is_ready(pod) or pods.lost_reason(pod) is not None:
            return await self._site(sandbox_id, pod)
        if await self._token(name, sandbox_id) is None:
            await self._delete(name)  # place() waits for the watch to see it gone
            return None
        spec = manifests.spec_of((pod.get("metadata") or {}).get("annotations") or {})
        return await self._settled(sandbox_id, spec or SandboxSpec(image="unknown", sandbox_id=sandbox_id))

    async def locate(self, sandbox_id: str) -> AgentSite:
        await self._start()
        name = manifests.pod_name(sandbox_id)
        pod = self._watch.pods.get(name)
        if name in self._deleted and pod is not None:  # deleted by us; the watch has yet to say so
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        if pod is None or (pod.get("metadata") or {}).get("annotations", {}).get(manifests.SANDBOX_ANNOTATION) \
                != sandbox_id:
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return await self._site(sandbox_id, pod)

    async def sites(self) -> list[AgentSite]:
        await self._start()
        found = []
        for pod in list(self._watch.pods.values()):
            sandbox_id = ((pod.get("metadata") or {}).get("annotations") or {}).get(manifests.SANDBOX_ANNOTATION)
            if sandbox_id and (pod["metadata"]["name"] not in self._deleted) and \
                    (pods.is_ready(pod) or pods.lost_reason(pod) is not None):
                found.append(await self._site(sandbox_id, pod))
        return found

    async def recheck(self, site: AgentSite) -> AgentSite:
        (sandbox_id,) = site.placed or {""}
        await asyncio.sleep(0.5)  # the watch reports an evicted or deleted pod within moments
        return await self._site(sandbox_id, self._watch.pods.get(site.key))

    async def delete(self, sandbox_id: str) -> None:
        """A sandbox whose pod has not started (no address yet; a create cut by its replica's
        death leaves such pods) has no agent to ask: its pod is deleted, and that is all."""
        site = await self.locate(sandbox_id)
        if site.api is None and site.lost is None:
            await self.release(site, sandbox_id)
            return
        await super().delete(sandbox_id)

    async def release(self, site: AgentSite, sandbox_id: str, *, failed: bool = False) -> None:
        await self._delete(site.key)

    async def _delete(self, name: str) -> None:
        from kubernetes.client import V1DeleteOptions

        await self._call(self._core.delete_namespaced_pod, name, self.config.namespace, missing_ok=True,
                         body=V1DeleteOptions(grace_period_seconds=0, propagation_policy="Background"))
        if name in self._watch.pods:
            self._deleted.add(name)  # until the watch reports it gone
            self._watch.on_gone(name, self._deleted.discard)
        self._tokens.pop(name, None)
        api = self._agents.pop(name, None)
        if api is not None:
            await api.close()

    def agent_spec(self, spec: SandboxSpec) -> SandboxSpec:
        # the pod is the sandbox: its agent runs commands in place; limits are the pod's
        return spec.model_copy(update={"image": "host", "memory": None, "cpu": None, "disk": None, "pids": None})

    def answered(self, body: dict[str, Any], spec: Optional[SandboxSpec] = None) -> Sandbox:
        """The agent in a pod sees image 'host' and no limits: report what the pod was made with."""
        if spec is None:
            pod = self._watch.pods.get(manifests.pod_name(str(body.get("sandbox_id", "")))) if self._watch else None
            spec = manifests.spec_of(((pod or {}).get("metadata") or {}).get("annotations") or {})
        sandbox = super().answered(body, spec)
        if spec is not None:
            sandbox = sandbox.model_copy(update={"cpu": spec.cpu, "memory": spec.memory, "disk": spec.disk})
        return sandbox

    async def resources(self) -> dict[str, Any]:
        await self._start()
        return {"pods": len(self._watch.pods), "api_calls": self.api_calls, "watch_lists": self._watch.lists,
                "namespace": self.config.namespace, "instance": self.config.instance}

    async def close(self) -> None:
        for api in self._agents.values():
            await api.close()
        self._agents.clear()
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
