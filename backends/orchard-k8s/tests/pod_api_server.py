"""A TEST DOUBLE of the Kubernetes API server and kubelet: no API server can be installed on
our machines. It speaks the subset the backend uses (pods, secrets, networkpolicies: create,
get, list with label selectors, watch with resourceVersion and bookmarks, delete; Status
bodies, 404, 409, 410 Gone on a compacted version) and plays the kubelet: each pod's agent
runs from the agent bundle as a local process in namespaces of its own (bubblewrap, as an
unprivileged user, the image root read-only with tmpfs on /tmp, /workspace, /root and
/home), with no network at all unless a network policy allows its egress. Deviations from
a real cluster, each named: every pod's IP is a loopback address of its own, where the
kubelet double relays the agent's port to the agent's socket (handed in as a descriptor,
``--fd``, instead of ``--host/--port``); the bundle is bound in as an image volume would
be (no init container runs); images are directories registered by name.

Faults the tests inject: API answers (429, 500) for the next calls, image pull errors,
unschedulable pods, eviction, OOM kill, node loss and preemption (DisruptionTarget), and a
compacted history (watches from an older version get 410 Gone).
"""

from __future__ import annotations

import asyncio
import copy
import errno
import json
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

AGENT_PORT_ARG = "--port"
KIT_IMAGE = "registry.test/orchard/kit:1"  # the conformance kit's image, registered by the tests


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, reason: str, message: str) -> JSONResponse:
    return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                         "message": message, "reason": reason, "code": code}, status_code=code)


WRITABLE = ("tmp", "workspace", "root", "home")
# containerd's and CRI-O's defaults (runc): masked with an empty file or directory, and read-only
MASKED = ("/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
          "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi")  # (/sys/firmware too: the double shows no /sys)
READ_ONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
CGROUP_BASE = "orchard-k8s-test-kubelet"  # tmpfs in every pod; the rest of the image is read-only


def runtime_defaults(empty: Path) -> list[str]:
    """/proc and /sys as a container runtime shows them to a pod by default."""
    args: list[str] = []
    for path in MASKED:
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.exists(path):
            args += ["--ro-bind", str(empty), path]
    for path in READ_ONLY:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def pod_dir_name(namespace: str, name: str) -> str:
    """The pod's directory and cgroup name on this host: a pod is its namespace and name
    (namespaces are DNS labels, without dots), as a kubelet tells pods apart."""
    return f"{namespace}.{name}"


def pod_cgroups(name: str, limits: dict[str, str]) -> list[Path]:
    """The cgroups of the pod ``name`` (``pod_dir_name``) (v1 memory, cpu, pids) with its limits, as the kubelet makes them;
    returns the cgroup.procs files to join."""
    from orchard.quantities import parse_cpu, parse_memory

    procs = []
    for controller in ("memory", "cpu", "pids"):
        base = Path("/sys/fs/cgroup") / controller
        if not (base / "cgroup.procs").exists():
            continue
        group = base / CGROUP_BASE / name
        group.mkdir(parents=True, exist_ok=True)
        if controller == "memory" and "memory" in limits:
            (group / "memory.limit_in_bytes").write_text(str(parse_memory(limits["memory"])))
        if controller == "cpu" and "cpu" in limits:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text(str(int(parse_cpu(limits["cpu"]) * 100000)))
        procs.append(group / "cgroup.procs")
    return procs


async def remove_pod_cgroups(name: str, patience: float = 5.0) -> None:
    """Kill whatever is left in the pod's cgroups and remove them, deepest first, as the
    kubelet does: the pod's process group is not all of it (the agent's sandboxes sit in
    their own groups), and a cgroup stays busy until its last process is reaped."""
    from orchard.agent.cgroups import SandboxCgroup

    pod = SandboxCgroup({c: Path("/sys/fs/cgroup") / c / CGROUP_BASE / name for c in ("memory", "cpu", "pids")})
    deadline = time.monotonic() + patience
    while True:
        pod.dirs = {c: d for c, d in pod.dirs.items() if d.exists()}
        pod.kill_all()
        if pod.remove() or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.02)


def root_args(image: Path, disk: Optional[int] = None) -> list[str]:
    """The pod's root: a tmpfs showing the image's top-level entries read-only (so mount points
    such as /orchard can be made, as a container runtime makes them) and tmpfs where it writes."""
    args = ["--tmpfs", "/"]
    for entry in sorted(image.iterdir()):
        if entry.name in WRITABLE or entry.name in ("proc", "dev"):
            continue
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry), f"/{entry.name}"]
        else:
            args += ["--ro-bind", str(entry), f"/{entry.name}"]
    size = ["--size", str(disk)] if disk else []  # where a real kubelet would evict the pod instead
    return args + [arg for name in WRITABLE for arg in (*size, "--tmpfs", f"/{name}")]


def matches(labels: dict[str, str], selector: Optional[str]) -> bool:
    for term in (selector or "").split(","):
        if term:
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
    return True


class PodApiTestServer:
    def __init__(self, bundle: Path, images: dict[str, Path]) -> None:
        self.bundle, self.images = bundle, images
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (resource, namespace, name)
        self.version = 0
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []  # (version, resource, type, object)
        self.floor = 0  # watches from a version below this get 410 Gone
        self.requests: Counter[tuple[str, str]] = Counter()  # (method, resource), watches excluded
        self.watches = 0
        self.faults: list[int] = []  # answer the next API calls with these statuses
        self.faults_for: dict[tuple[str, str], list[Optional[int]]] = {}  # the same, for one (method, resource)
        # only; None: that call is answered as usual
        self.pull_errors: dict[str, str] = {}
        self.unschedulable: Optional[str] = None
        self.watch_delay = 0.0  # seconds between a change and its watch event
        self._watchers: list[tuple[str, str, Optional[str], asyncio.Queue]] = []
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> kubelet state
        self._next_ip = secrets.randbelow(200 << 16) + (1 << 16)  # 127.1.0.0 - 127.200.255.255, from anywhere
        self._work = Path(tempfile.mkdtemp(prefix="orchard-k8s-kubelet-"))
        self._work.chmod(0o711)
        self._empty = self._work / "empty"
        self._empty.touch(mode=0o444)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.app = self._routes()
        self.url = ""
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None

    # -- running it ----------------------------------------------------------------------
    def start(self) -> "PodApiTestServer":
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        started = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_until_complete(self._server.serve(sockets=[listener]))  # type: ignore[union-attr]

        self._thread = threading.Thread(target=run, name="pod-api-test-server", daemon=True)
        self._thread.start()
        started.wait(10)
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def call(self, coroutine: Any) -> Any:
        """Run a coroutine on the server's loop (fault injection from a test's thread)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def stop(self) -> None:
        if self.loop is not None:
            for namespace, name in list(self._pods):
                self.call(self._stop_pod(namespace, name))
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        shutil.rmtree(self._work, ignore_errors=True)

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
        return path

    def pod_calls(self) -> int:
        """API requests about pods and secrets (creates, reads, deletes); the shared watch, its
        listings included, is counted apart (``watches``, LIST requests)."""
        return sum(n for (method, resource), n in self.requests.items()
                   if resource in ("pods", "secrets") and method != "LIST")

    # -- the store -------------------------------------------------------------------
    def _record(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        event = (self.version, resource, kind, copy.deepcopy(obj))
        self.history.append(event)
        for watched, namespace, selector, queue in self._watchers:
            if watched == resource and obj["metadata"].get("namespace") == namespace \
                    and matches(obj["metadata"].get("labels") or {}, selector):
                if self.watch_delay:  # a slow watch: events arrive after the API calls answer
                    asyncio.get_running_loop().call_later(self.watch_delay, queue.put_nowait, event)
                else:
                    queue.put_nowait(event)

    def _store(self, resource: str, obj: dict[str, Any], kind: str = "MODIFIED") -> None:
        key = (resource, obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.objects[key] = obj
        self._record(resource, kind, obj)

    def _remove(self, resource: str, namespace: str, name: str) -> Optional[dict[str, Any]]:
        obj = self.objects.pop((resource, namespace, name), None)
        if obj is not None:
            self._record(resource, "DELETED", obj)
            if resource == "pods":  # garbage collection of what the pod owns
                for (res, ns, other), owned in list(self.objects.items()):
                    refs = owned["metadata"].get("ownerReferences") or []
                    if ns == namespace and any(ref.get("uid") == obj["metadata"]["uid"] for ref in refs):
                        self._remove(res, ns, other)
        return obj

    def compact(self) -> None:
        """Forget the history: watches resuming from any version seen so far get 410 Gone."""
        self.history.clear()
        self.floor = self.version + 1
        for _, _, _, queue in self._watchers:
            queue.put_nowait(None)  # end live watches too, as an API server restart would

    # -- the API -------------------------------------------------------------------------
    def _routes(self) -> FastAPI:
        app = FastAPI()
        prefixes = {"pods": "/api/v1", "secrets": "/api/v1", "networkpolicies": "/apis/networking.k8s.io/v1"}
        kinds = {"pods": "Pod", "secrets": "Secret", "networkpolicies": "NetworkPolicy"}
        for resource, prefix in prefixes.items():
            collection = f"{prefix}/namespaces/{{namespace}}/{resource}"

            async def create(namespace: str, request: Request, resource: str = resource) -> Any:
                return await self._create(resource, namespace, await request.json())

            async def listing(namespace: str, request: Request, resource: str = resource,
                              kind: str = kinds[resource]) -> Any:
                params = request.query_params
                if params.get("watch") in ("true", "1", "True"):
                    return self._watch(resource, namespace, params)
                return self._list(resource, kind, namespace, params.get("labelSelector"))

            async def read(namespace: str, name: str, resource: str = resource) -> Any:
                return self._read(resource, namespace, name)

            async def delete(namespace: str, name: str, request: Request, resource: str = resource) -> Any:
                body = json.loads(await request.body() or b"{}")
                return await self._delete(resource, namespace, name, (body.get("preconditions") or {}).get("uid"))

            app.add_api_route(collection, create, methods=["POST"])
            app.add_api_route(collection, listing, methods=["GET"])
            app.add_api_route(f"{collection}/{{name}}", read, methods=["GET"])
            app.add_api_route(f"{collection}/{{name}}", delete, methods=["DELETE"])
        return app

    def _fault(self, method: str, resource: str) -> Optional[JSONResponse]:
        self.requests[(method, resource)] += 1
        aimed = self.faults_for.get((method, resource))
        if self.faults or aimed:
            code = aimed.pop(0) if aimed else self.faults.pop(0)
            if code is None:
                return None
            reason = {403: "Forbidden", 409: "AlreadyExists", 429: "TooManyRequests"}.get(code, "InternalError")
            response = status_body(code, reason, f"injected {code}")
            if code == 429:
                response.headers["Retry-After"] = "0"
            return response
        return None

    async def _create(self, resource: str, namespace: str, body: dict[str, Any]) -> Any:
        fault = self._fault("POST", resource)
        if fault is not None:
            return fault
        metadata = body.setdefault("metadata", {})
        name = metadata.get("name", "")
        if not isinstance(name, str) or not DNS_SUBDOMAIN.fullmatch(name) or len(name) > 253:
            # as the API server refuses it; here also what keeps ".." or "" out of the pod's cgroup paths
            return status_body(422, "Invalid", f'{resource} "{name}" is invalid: metadata.name: a lowercase RFC 1123 '
                                               "subdomain is required")
        if (resource, namespace, name) in self.objects:
            return status_body(409, "AlreadyExists", f'{resource} "{name}" already exists')
        metadata.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=now())
        if resource == "pods":
            body["status"] = {"phase": "Pending", "conditions": []}
        self._store(resource, body, "ADDED")
        if resource == "pods":
            self._pods[namespace, name] = {"namespace": namespace}
            asyncio.get_running_loop().create_task(self._kubelet(namespace, name))
        return JSONResponse(body, status_code=201)

    def _list(self, resource: str, kind: str, namespace: str, selector: Optional[str]) -> Any:
        fault = self._fault("LIST", resource)
        if fault is not None:
            return fault
        items = [obj for (res, ns, _), obj in self.objects.items()
                 if res == resource and ns == namespace and matches(obj["metadata"].get("labels") or {}, selector)]
        return {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)},
                "items": items}

    def _read(self, resource: str, namespace: str, name: str) -> Any:
        fault = self._fault("GET", resource)
        if fault is not None:
            return fault
        obj = self.objects.get((resource, namespace, name))
        return obj if obj is not None else status_body(404, "NotFound", f'{resource} "{name}" not found')

    async def _delete(self, resource: str, namespace: str, name: str, uid: Optional[str] = None) -> Any:
        fault = self._fault("DELETE", resource)
        if fault is not None:
            return fault
        obj = self.objects.get((resource, namespace, name))
        if obj is None:
            return status_body(404, "NotFound", f'{resource} "{name}" not found')
        if uid is not None and obj["metadata"]["uid"] != uid:  # a precondition, as the API server checks it
            return status_body(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, "
                                                f"UID in object meta: {obj['metadata']['uid']}")
        if resource == "pods":
            await self._stop_pod(namespace, name)
        obj = self._remove(resource, namespace, name)
        return obj

    def _watch(self, resource: str, namespace: str, params: Any) -> StreamingResponse:
        self.watches += 1
        since = int(params.get("resourceVersion") or 0)
        selector = params.get("labelSelector")
        bookmarks = params.get("allowWatchBookmarks") in ("true", "1", "True")
        timeout = float(params.get("timeoutSeconds") or 60)
        queue: asyncio.Queue = asyncio.Queue()
        entry = (resource, namespace, selector, queue)

        async def stream() -> AsyncIterator[bytes]:
            if since and since < self.floor:
                yield json.dumps({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410,
                    "message": f"too old resource version: {since} ({self.floor})"}}).encode() + b"\n"
                return
            self._watchers.append(entry)
            try:
                for version, res, kind, obj in list(self.history):
                    if version > since and res == resource and obj["metadata"].get("namespace") == namespace \
                            and matches(obj["metadata"].get("labels") or {}, selector):
                        yield json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    try:
                        event = await asyncio.wait_for(queue.get(), 1.0)
                    except asyncio.TimeoutError:
                        if bookmarks:
                            yield json.dumps({"type": "BOOKMARK", "object": {
                                "kind": "Pod", "apiVersion": "v1",
                                "metadata": {"resourceVersion": str(self.version)}}}).encode() + b"\n"
                        continue
                    if event is None:
                        return
                    yield json.dumps({"type": event[2], "object": event[3]}).encode() + b"\n"
            finally:
                self._watchers.remove(entry)

        return StreamingResponse(stream(), media_type="application/json")

    # -- the kubelet ---------------------------------------------------------------------
    def _pod(self, namespace: str, name: str) -> Optional[dict[str, Any]]:
        return self.objects.get(("pods", namespace, name))

    def _set_status(self, namespace: str, name: str, **changes: Any) -> None:
        pod = self._pod(namespace, name)
        if pod is not None:
            pod["status"].update(changes)
            self._store("pods", pod)

    def _waiting(self, namespace: str, name: str, reason: str, message: str) -> None:
        self._set_status(namespace, name, containerStatuses=[{
            "name": "sandbox", "ready": False, "restartCount": 0, "image": "", "imageID": "",
            "state": {"waiting": {"reason": reason, "message": message}}}])

    def _egress_allowed(self, namespace: str, labels: dict[str, str]) -> bool:
        """As a CNI enforcing the namespace's policies would decide: open unless an Egress
        policy selects the pod, then open only if one of those allows any egress."""
        selecting = [p for (res, ns, _), p in self.objects.items() if res == "networkpolicies" and ns == namespace
                     and "Egress" in p["spec"].get("policyTypes", [])
                     and matches(labels, ",".join(f"{k}={v}" for k, v in
                                                  p["spec"]["podSelector"].get("matchLabels", {}).items()))]
        return not selecting or any(p["spec"].get("egress") for p in selecting)

    async def _kubelet(self, namespace: str, name: str) -> None:
        await asyncio.sleep(0.01)
        pod = self._pod(namespace, name)
        if pod is None:
            return
        if self.unschedulable:
            self._set_status(namespace, name, conditions=[{"type": "PodScheduled", "status": "False",
                                                           "reason": "Unschedulable", "message": self.unschedulable}])
            return
        self._set_status(namespace, name, conditions=[{"type": "PodScheduled", "status": "True"}], hostIP="127.0.0.1")
        container = pod["spec"]["containers"][0]
        image = container["image"]
        if image in self.pull_errors or image not in self.images:
            why = self.pull_errors.get(image, f'failed to pull image "{image}": not found')
            self._waiting(namespace, name, "ErrImagePull", why)
            return
        uid = pod["metadata"]["uid"]

        def mine() -> bool:
            """Whether pod ``name`` is still this one: deleted meanwhile, another pod may have its name."""
            return (self._pod(namespace, name) or {}).get("metadata", {}).get("uid") == uid

        token = await self._secret_value(namespace, container)
        if not mine():
            return
        if token is None:  # as a kubelet, say so and keep trying: a creator on a busy host makes it late
            self._waiting(namespace, name, "CreateContainerConfigError", "secret not found")
            while token is None:
                token = await self._secret_value(namespace, container)
                if not mine():
                    return
        state = self._pods.get((namespace, name))
        if state is None:
            return
        host_name = pod_dir_name(namespace, name)
        port = int(container["command"][container["command"].index(AGENT_PORT_ARG) + 1])
        limits = (container.get("resources") or {}).get("limits") or {}
        from orchard.quantities import parse_bytes

        disk = parse_bytes(limits["ephemeral-storage"]) if "ephemeral-storage" in limits else None
        cgroups = pod_cgroups(host_name, limits)
        directory = self._work / pod["metadata"]["uid"]  # short: the agent's socket path must fit in 108 bytes
        directory.mkdir(mode=0o700)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(directory / "agent.sock"))
        listener.listen(64)
        os.chown(directory / "agent.sock", 65534, 65534)
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                "bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                "--cap-drop", "ALL", "--hostname", pod["spec"].get("hostname", name)[:63],
                "--as-pid-1", *root_args(self.images[image], disk), "--proc", "/proc", "--dev", "/dev",
                *runtime_defaults(self._empty), "--ro-bind", str(self.bundle), "/orchard", "--chdir", "/workspace"]
        if not self._egress_allowed(namespace, pod["metadata"].get("labels") or {}):
            argv.append("--unshare-net")
        command = container["command"]
        cut = command.index("--host")
        agent = [*command[:cut], *command[cut + 4:], "--fd", str(listener.fileno())]  # --host H --port P dropped
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
               "ORCHARD_AGENT_TOKEN": token,
               **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
        process = await asyncio.create_subprocess_exec(*argv, "--", *agent, env=env, pass_fds=(listener.fileno(),),
                                                       stdin=asyncio.subprocess.DEVNULL,
                                                       stdout=asyncio.subprocess.DEVNULL,
                                                       stderr=open(directory / "agent.log", "wb"),
                                                       start_new_session=True,
                                                       preexec_fn=lambda: [p.write_text(str(os.getpid()))
                                                                           for p in cgroups])
        listener.close()
        ip, relay = await self._pod_address(directory / "agent.sock", port)
        state.update(process=process, relay=relay, ip=ip, directory=directory)
        if state.get("stopping") or not mine():  # deleted while its agent started: _stop_pod found no process
            state["stopping"] = True
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            relay.close()
            shutil.rmtree(directory, ignore_errors=True)
            await remove_pod_cgroups(host_name)
            return
        if not await self._agent_healthy(directory / "agent.sock", process):
            if state.get("stopping") or not mine():  # deleted: its status is not ours to write
                return
            try:
                log = (directory / "agent.log").read_text(errors="replace")[-1500:]
            except OSError:  # the pod was deleted while its agent started
                log = ""
            self._terminated(namespace, name, "Error", process.returncode or 1, message=log)
            return
        if state.get("stopping") or not mine():
            return
        self._set_status(namespace, name, phase="Running", podIP=ip, podIPs=[{"ip": ip}], startTime=now(),
                         conditions=[{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"},
                                     {"type": "ContainersReady", "status": "True"}],
                         containerStatuses=[{"name": "sandbox", "ready": True, "restartCount": 0, "image": image,
                                             "imageID": image, "state": {"running": {"startedAt": now()}}}])
        code = await process.wait()
        if (namespace, name) in self._pods and not state.get("stopping") and mine():
            self._terminated(namespace, name, state.get("ended_as", "Error"), code)

    async def _pod_address(self, socket_path: Path, port: int) -> tuple[str, asyncio.AbstractServer]:
        """A loopback address of the pod's own, its agent's port relayed there; an address
        another double on this host holds (tests and a bench at once) is skipped."""
        for _ in range(1000):
            self._next_ip += 1
            if self._next_ip & 255 in (0, 255):
                continue
            ip = f"127.{self._next_ip >> 16 & 255}.{self._next_ip >> 8 & 255}.{self._next_ip & 255}"
            try:
                return ip, await asyncio.start_server(lambda r, w: self._relay(socket_path, r, w), ip, port)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        raise RuntimeError("no free loopback address for a pod")

    async def _secret_value(self, namespace: str, container: dict[str, Any]) -> Optional[str]:
        import base64

        ref = next((e["valueFrom"]["secretKeyRef"] for e in container.get("env", []) if "valueFrom" in e), None)
        if ref is None:
            return ""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            secret = self.objects.get(("secrets", namespace, ref["name"]))
            if secret is not None:
                return base64.b64decode(secret["data"][ref["key"]]).decode()
            await asyncio.sleep(0.02)
        return None

    async def _agent_healthy(self, path: Path, process: asyncio.subprocess.Process, timeout: float = 600) -> bool:
        """Whether the agent answers /health before it exits: a kubelet keeps a pod unready
        while its readiness probe fails and never kills it for that (the bound only keeps a
        stuck double from waiting for ever; on a busy host an agent may take a minute)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.returncode is None:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path))
                writer.write(b"GET /health HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\r\n")
                await writer.drain()
                head = await asyncio.wait_for(reader.read(64), 2)
                writer.close()
                if head.startswith(b"HTTP/1.1 200"):
                    return True
            except (OSError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.05)
        return False

    async def _relay(self, path: Path, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            agent_reader, agent_writer = await asyncio.open_unix_connection(str(path))
        except OSError:
            writer.close()
            return

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pump(reader, agent_writer), pump(agent_reader, writer))

    def _terminated(self, namespace: str, name: str, reason: str, code: int, phase: str = "Failed",
                    message: str = "") -> None:
        self._set_status(namespace, name, phase=phase, reason=reason if reason == "Evicted" else None,
                         message=message or None,
                         conditions=[{"type": "Ready", "status": "False"}],
                         containerStatuses=[{"name": "sandbox", "ready": False, "restartCount": 0, "image": "",
                                             "imageID": "", "state": {"terminated": {
                                                 "reason": reason, "exitCode": code, "message": message or None}}}])

    async def _stop_pod(self, namespace: str, name: str) -> None:
        state = self._pods.pop((namespace, name), None)
        if not state:
            return
        state["stopping"] = True
        process = state.get("process")
        if process is not None and process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await process.wait()
        relay = state.get("relay")
        if relay is not None:
            relay.close()
        if state.get("directory"):
            shutil.rmtree(state["directory"], ignore_errors=True)
        await remove_pod_cgroups(pod_dir_name(namespace, name))

    # -- faults ------------------------------------------------------------------------
    async def _kill(self, namespace: str, name: str, ended_as: str) -> None:
        state = self._pods[namespace, name]
        state["ended_as"] = ended_as
        os.killpg(state["process"].pid, signal.SIGKILL)

    def oom_kill(self, namespace: str, name: str) -> None:
        self.call(self._kill(namespace, name, "OOMKilled"))

    async def _evict(self, namespace: str, name: str) -> None:
        state = self._pods[namespace, name]
        state["stopping"] = True
        os.killpg(state["process"].pid, signal.SIGKILL)
        await state["process"].wait()
        pod = self._pod(namespace, name)
        assert pod is not None
        pod["status"].update(phase="Failed", reason="Evicted",
                             message="The node was low on resource: memory. Threshold quantity: 100Mi.")
        self._store("pods", pod)

    def evict(self, namespace: str, name: str) -> None:
        self.call(self._evict(namespace, name))

    async def _disrupt(self, namespace: str, name: str, reason: str, message: str) -> None:
        pod = self._pod(namespace, name)
        assert pod is not None
        pod["status"]["conditions"] = [*(pod["status"].get("conditions") or []),
                                       {"type": "DisruptionTarget", "status": "True", "reason": reason,
                                        "message": message}]
        pod["metadata"]["deletionTimestamp"] = now()
        self._store("pods", pod)

    def lose_node(self, namespace: str, name: str) -> None:
        self.call(self._disrupt(namespace, name, "DeletionByTaintManager",
                                "Taint manager: deleting due to NoExecute taint node.kubernetes.io/unreachable"))

    def preempt(self, namespace: str, name: str) -> None:
        self.call(self._disrupt(namespace, name, "PreemptionByScheduler", "preempted by a higher-priority pod"))

    def inject(self, *statuses: int) -> None:
        self.faults.extend(statuses)
