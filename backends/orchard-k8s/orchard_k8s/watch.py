"""One informer-style watch of this server's sandbox pods, shared by every sandbox: list,
then watch from the list's resourceVersion with bookmarks; on 410 Gone list again; on a
dropped connection watch again from the last version seen. Readiness and loss are read
from its cache, so the API server never sees a poll per pod.

The official client is synchronous: the watch runs in a thread and hands each event to the
event loop, where the cache lives and waiters wake.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Optional

from kubernetes import watch
from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("orchard.k8s")
WATCH_SECONDS = 240  # the server ends a watch after this; we resume from the last version


class PodWatch:
    def __init__(self, core: CoreV1Api, namespace: str, selector: str, loop: asyncio.AbstractEventLoop) -> None:
        self.core, self.namespace, self.selector, self.loop = core, namespace, selector, loop
        self.pods: dict[str, dict[str, Any]] = {}  # name -> pod (plain dict, API field names)
        self.synced = asyncio.Event()
        self.lists = 0  # full listings made (1, plus one per 410 Gone)
        self._waiters: dict[str, set[asyncio.Event]] = {}  # pod name -> one event per waiter
        self._gone: dict[str, list[Callable[[str], None]]] = {}
        self._stopping = threading.Event()
        self._watch: Optional[watch.Watch] = None
        self._thread = threading.Thread(target=self._run, name="orchard-k8s-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._watch is not None:
            self._watch.stop()

    # -- on the event loop ---------------------------------------------------------
    def on_gone(self, name: str, callback: Callable[[str], None]) -> None:
        """Call ``callback(name)`` once the watch reports pod ``name`` gone."""
        if name not in self.pods:
            callback(name)
        else:
            self._gone.setdefault(name, []).append(callback)

    def _forgotten(self, name: str) -> None:
        for callback in self._gone.pop(name, []):
            callback(name)

    def _apply(self, kind: str, pod: dict[str, Any]) -> None:
        name = pod.get("metadata", {}).get("name", "")
        if kind == "DELETED":
            self.pods.pop(name, None)
            self._forgotten(name)
        else:
            self.pods[name] = pod
        self._wake(name)

    def _replace(self, pods: list[dict[str, Any]]) -> None:
        gone = set(self.pods) - {p["metadata"]["name"] for p in pods}
        self.pods = {p["metadata"]["name"]: p for p in pods}
        for name in gone:
            self._forgotten(name)
        for name in gone | set(self.pods):
            self._wake(name)
        self.synced.set()

    def _wake(self, name: str) -> None:
        for event in self._waiters.get(name, ()):
            event.set()

    async def wait_for(self, name: str, done: Callable[[Optional[dict[str, Any]]], bool], timeout: float) -> \
            Optional[dict[str, Any]]:
        """Wait until ``done(pod or None)`` holds for pod ``name``; returns the pod (None if gone)."""
        deadline = time.monotonic() + timeout
        event = asyncio.Event()  # its own: another waiter on this pod leaving must not take it away
        self._waiters.setdefault(name, set()).add(event)
        try:
            while not done(self.pods.get(name)):
                event.clear()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(event.wait(), remaining)
            return self.pods.get(name)
        finally:
            waiters = self._waiters.get(name, set())
            waiters.discard(event)
            if not waiters:
                self._waiters.pop(name, None)

    # -- in the thread ---------------------------------------------------------------
    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stopping.set()

    def _run(self) -> None:
        plain = ApiClient().sanitize_for_serialization
        version: Optional[str] = None
        failures = 0
        while not self._stopping.is_set():
            try:
                if version is None:
                    listing = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
                    self.lists += 1
                    version = listing.metadata.resource_version
                    self._post(self._replace, [plain(pod) for pod in listing.items])
                self._watch = watch.Watch()
                for event in self._watch.stream(self.core.list_namespaced_pod, self.namespace,
                                                label_selector=self.selector, resource_version=version,
                                                allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS):
                    pod = plain(event["object"])
                    version = pod.get("metadata", {}).get("resourceVersion") or version
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._post(self._apply, event["type"], pod)
                    failures = 0
            except ApiException as exc:
                if exc.status == 410:  # our version is too old: list again
                    version = None
                    continue
                failures += 1
                log.warning("pod watch: API answered %s; retrying", exc.status)
            except Exception as exc:  # a dropped connection: resume from the last version seen
                failures += 1
                log.warning("pod watch: %s: %s; retrying", type(exc).__name__, exc)
            if not self._stopping.is_set() and failures:
                time.sleep(min(5.0, 0.1 * 2 ** min(failures, 6)))
