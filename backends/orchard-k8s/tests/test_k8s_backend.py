"""The k8s backend through the real ``kubernetes`` client against the Pod-API test server
(a test double of the API server and kubelet, see pod_api_server.py)."""

from __future__ import annotations

import time

import httpx
import pytest

from pod_api_server import KIT_IMAGE
from orchard.client import Client
from orchard.errors import BackendUnavailable, ImageRejected, InvalidRequest
from orchard_k8s import manifests


@pytest.fixture
def k8s(k8s_settings):
    with Client(backend="k8s", backend_settings=k8s_settings) as client:
        yield client


@pytest.fixture
def core_api(k8s_settings):
    """The real ``kubernetes`` client on the Pod-API test server, for what another server would do."""
    from kubernetes import client, config as kube_config

    return client.CoreV1Api(kube_config.new_client_from_config(k8s_settings["kubeconfig"]))


def test_a_sandbox_is_a_pod_with_the_agent_inside_and_costs_three_api_calls(k8s, pod_api):
    before = pod_api.pod_calls()
    watches = pod_api.watches
    sandbox = k8s.create(KIT_IMAGE, labels={"task": "demo"})
    assert sandbox.info.image == KIT_IMAGE and sandbox.info.backend == "k8s"
    assert sandbox.exec("echo hello from $(cat /proc/sys/kernel/hostname)").stdout == f"hello from {manifests.pod_name(sandbox.id)}\n"
    sandbox.upload("notes.txt", "kept\n")
    assert sandbox.download("notes.txt") == b"kept\n"
    assert k8s.get(sandbox.id).info.status == "ready"
    assert sandbox.id in {s.sandbox_id for s in k8s.list()}
    sandbox.delete()
    assert pod_api.pod_calls() - before == 3  # create pod, create its key's Secret, delete the pod
    assert pod_api.watches - watches <= 1  # one shared watch (opened once per backend)
    name = manifests.pod_name(sandbox.id)
    assert ("pods", "orchard-test", name) not in pod_api.objects
    assert ("secrets", "orchard-test", manifests.secret_name(sandbox.id)) not in pod_api.objects  # owned by the pod


def test_the_agent_key_is_never_in_the_pod_spec(k8s, pod_api):
    with k8s.create(KIT_IMAGE) as sandbox:
        pod = pod_api.objects[("pods", "orchard-test", manifests.pod_name(sandbox.id))]
        secret = pod_api.objects[("secrets", "orchard-test", manifests.secret_name(sandbox.id))]
        import base64

        token = base64.b64decode(secret["data"]["token"]).decode()
        assert len(token) > 30 and token not in str(pod)


def test_an_image_that_cannot_be_pulled_fails_within_seconds_with_the_registrys_reason(k8s, pod_api):
    pod_api.pull_errors["registry.test/missing:1"] = 'rpc error: manifest for registry.test/missing:1 not found'
    started = time.monotonic()
    with pytest.raises(ImageRejected, match="ErrImagePull.*manifest for registry.test/missing:1 not found"):
        k8s.create("registry.test/missing:1")
    assert time.monotonic() - started < 10
    assert not [key for key in pod_api.objects if key[0] == "pods" and "missing" in str(pod_api.objects[key])]


def test_unschedulable_pods_say_why(k8s_settings, pod_api):
    pod_api.unschedulable = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    try:
        with Client(backend="k8s", backend_settings={**k8s_settings, "start_timeout": 2}) as client:
            with pytest.raises(Exception, match="Unschedulable: 0/3 nodes are available: 3 Insufficient"):
                client.create(KIT_IMAGE)
    finally:
        pod_api.unschedulable = None


@pytest.mark.parametrize("fault,reason", [("evict", "Evicted: The node was low on resource: memory"),
                                          ("oom_kill", "OOMKilled"),
                                          ("lose_node", "DeletionByTaintManager"),
                                          ("preempt", "PreemptionByScheduler")])
def test_a_pod_that_goes_away_marks_its_sandbox_lost_with_the_reason(k8s, pod_api, fault, reason):
    sandbox = k8s.create(KIT_IMAGE)
    name = manifests.pod_name(sandbox.id)
    getattr(pod_api, fault)("orchard-test", name)
    deadline = time.monotonic() + 10
    while (info := k8s.get(sandbox.id).info).status != "lost":
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    assert reason in (info.status_message or ""), info.status_message
    sandbox.delete()


def test_api_throttling_and_server_errors_are_retried(k8s, pod_api):
    pod_api.inject(429, 500, 503)
    with k8s.create(KIT_IMAGE) as sandbox:
        assert sandbox.exec("echo through").stdout == "through\n"


def test_the_watch_lists_again_after_410_gone(k8s_settings, pod_api):
    import asyncio

    from orchard.backends.loading import load_backend

    async def scenario() -> None:
        backend = load_backend("k8s", k8s_settings)
        await backend.resources()  # starts the shared watch
        lists = backend._watch.lists
        pod_api.compact()  # the API server forgot the history: the watch's version is gone
        from orchard.models import SandboxSpec

        sandbox = await backend.create(SandboxSpec(image=KIT_IMAGE))
        assert backend._watch.lists > lists  # it listed again, and still saw the new pod get ready
        await backend.delete(sandbox.sandbox_id)
        await backend.close()

    asyncio.run(scenario())


def test_a_restarted_server_adopts_its_pods(k8s_settings):
    with Client(backend="k8s", backend_settings=k8s_settings) as first:
        sandbox = first.create(KIT_IMAGE)
        sandbox.exec("echo remembered > /tmp/state")
    with Client(backend="k8s", backend_settings=k8s_settings) as second:  # its key read from the Secret
        again = second.get(sandbox.id)
        assert again.exec("cat /tmp/state").stdout == "remembered\n"
        again.delete()


def test_limits_a_pod_cannot_have_are_refused_by_name(k8s):
    with pytest.raises(InvalidRequest, match="pids"):
        k8s.create(KIT_IMAGE, pids=64)


def test_a_deleted_sandbox_is_gone_at_once_even_before_the_watch_says_so(k8s, pod_api):
    """The watch trails the API: a get right after a delete found the pod still cached, tried
    its (already collected) key Secret and answered 503 instead of not found."""
    from orchard.errors import SandboxNotFound

    sandbox = k8s.create(KIT_IMAGE)
    pod_api.watch_delay = 1.0
    try:
        sandbox.delete()
        with pytest.raises(SandboxNotFound):
            k8s.get(sandbox.id)
        assert sandbox.id not in {s.sandbox_id for s in k8s.list()}
    finally:
        pod_api.watch_delay = 0.0


def test_a_deleted_pod_leaves_no_cgroup_behind_even_with_a_sandbox_process_running(k8s, pod_api):
    """The test kubelet removes a pod's cgroups as a kubelet does. It used to kill the pod's
    process group and rmdir at once, which failed while processes outside that group (the
    sandbox's, in sessions of their own) were still dying: 600 empty cgroups piled up over a
    day of test runs."""
    from pathlib import Path

    from pod_api_server import CGROUP_BASE, pod_dir_name

    before = set(pod_api._pods)
    sandbox = k8s.create(KIT_IMAGE)
    (pod,) = set(pod_api._pods) - before
    groups = [Path("/sys/fs/cgroup") / c / CGROUP_BASE / pod_dir_name(*pod) for c in ("memory", "cpu", "pids")]
    groups = [g for g in groups if g.exists()]
    assert groups, "the test kubelet made no cgroup for the pod"
    sandbox.exec("setsid sleep 600 >/dev/null 2>&1 &")
    sandbox.delete()
    deadline = time.monotonic() + 10
    while any(g.exists() for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [g for g in groups if g.exists()]


def test_a_pod_of_the_same_name_in_another_namespace_is_another_pod(k8s, k8s_settings, pod_api, core_api):
    """The test kubelet told pods apart by name alone: a pod of the same name in another
    namespace took over the first one's kubelet state, and deleting it killed what ran in
    the first one's cgroups. A kubelet knows a pod by namespace and name."""
    sandbox = k8s.create(KIT_IMAGE)
    name = manifests.pod_name(sandbox.id)
    other = "orchard-twin"
    core_api.create_namespaced_pod(other, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                                           "spec": {"containers": [{"name": "sandbox", "image": "no-such-image"}]}})
    assert {(k8s_settings["namespace"], name), (other, name)} <= set(pod_api._pods)
    core_api.delete_namespaced_pod(name, other)
    assert (other, name) not in pod_api._pods and (k8s_settings["namespace"], name) in pod_api._pods
    assert sandbox.exec("echo still here").stdout == "still here\n"
    sandbox.delete()


@pytest.mark.parametrize("name", ["..", "", "Upper", "a/b"])
def test_the_test_kubelet_refuses_pod_names_the_api_server_would(k8s_settings, pod_api, core_api, name):
    """Review: a pod named ".." made the double's cgroup path the hierarchy's root, and its
    teardown would have killed every process listed there."""
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as refused:
        core_api.create_namespaced_pod(k8s_settings["namespace"], {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "sandbox", "image": KIT_IMAGE}]}})
    assert refused.value.status == 422
    assert (k8s_settings["namespace"], name) not in pod_api._pods


def test_a_create_asked_again_after_its_creator_died_finishes_or_starts_over(k8s_settings, pod_api, core_api):
    """Another server (a replica that died, or this one before a restart) made the pod and
    never saw it ready: a create of that sandbox asked again waits for the pod and adopts it;
    if that server died between the pod and its key Secret, the pod can never start, so it
    is deleted and the sandbox made afresh. Before, the create failed: 409 while this server's
    watch had not yet shown the pod (seen failing so), 410 'lost' while the pod was starting."""
    import asyncio
    import base64
    import secrets

    from orchard.backends.loading import load_backend
    from orchard.models import SandboxSpec

    api, namespace = core_api, k8s_settings["namespace"]

    async def scenario() -> None:
        backend = load_backend("k8s", k8s_settings)
        await backend.resources()  # the shared watch runs: the create below finds the pod still starting
        settings = backend.config
        for with_secret in (True, False):
            spec = SandboxSpec(image=KIT_IMAGE, sandbox_id=f"died-{secrets.token_hex(4)}")
            made = api.create_namespaced_pod(namespace, manifests.pod_manifest(spec, settings))  # the dead server
            if with_secret:
                owner = {"name": made.metadata.name, "uid": made.metadata.uid}
                api.create_namespaced_secret(namespace, manifests.secret_manifest(
                    str(spec.sandbox_id), secrets.token_urlsafe(32), settings, owner))
            sandbox = await backend.create(spec)
            assert sandbox.status == "ready"
            pod = api.read_namespaced_pod(manifests.pod_name(str(spec.sandbox_id)), namespace)
            assert (pod.metadata.uid == made.metadata.uid) is with_secret  # adopted, or made afresh
            secret = api.read_namespaced_secret(manifests.secret_name(str(spec.sandbox_id)), namespace)
            assert base64.b64decode(secret.data["token"]).decode() == (await backend.endpoint(spec.sandbox_id)).token
            await backend.delete(str(spec.sandbox_id))
        await backend.close()

    asyncio.run(scenario())


def test_a_stale_key_secret_of_an_older_pod_is_replaced_never_trusted(k8s_settings, pod_api, core_api):
    """A key Secret of the sandbox's name owned by another pod (a dead replica's Secret
    request landing after the survivor replaced its key-less pod, or one the garbage collector
    has yet to remove) made the create fail 409. It is deleted, by uid, and a new key made:
    the stale token opens nothing. A failure to make the key deletes the pod it was for."""
    import asyncio
    import base64
    import secrets

    from orchard.backends.loading import load_backend
    from orchard.models import SandboxSpec

    api, namespace = core_api, k8s_settings["namespace"]

    async def scenario() -> None:
        backend = load_backend("k8s", k8s_settings)
        spec = SandboxSpec(image=KIT_IMAGE, sandbox_id=f"stale-{secrets.token_hex(4)}")
        stale_token = secrets.token_urlsafe(32)
        stale = api.create_namespaced_secret(namespace, manifests.secret_manifest(
            str(spec.sandbox_id), stale_token, backend.config, {"name": "gone", "uid": "0-old-pod"}))
        sandbox = await backend.create(spec)
        assert sandbox.status == "ready"
        secret = api.read_namespaced_secret(manifests.secret_name(str(spec.sandbox_id)), namespace)
        pod = api.read_namespaced_pod(manifests.pod_name(str(spec.sandbox_id)), namespace)
        assert secret.metadata.uid != stale.metadata.uid
        assert [ref.uid for ref in secret.metadata.owner_references] == [pod.metadata.uid]
        endpoint = await backend.endpoint(spec.sandbox_id)
        assert base64.b64decode(secret.data["token"]).decode() == endpoint.token != stale_token
        async with httpx.AsyncClient(base_url=endpoint.url) as agent:
            assert (await agent.get("/sandboxes", headers={"X-API-Key": endpoint.token})).status_code == 200
            assert (await agent.get("/sandboxes", headers={"X-API-Key": stale_token})).status_code in (401, 403)
        await backend.delete(str(spec.sandbox_id))

        failing = SandboxSpec(image=KIT_IMAGE, sandbox_id=f"nokey-{secrets.token_hex(4)}")
        pod_api.faults_for[("POST", "secrets")] = [403]  # the key cannot be made (RBAC, say)
        with pytest.raises(BackendUnavailable):
            await backend.create(failing)
        names = [pod.metadata.name for pod in api.list_namespaced_pod(namespace).items]
        assert manifests.pod_name(str(failing.sandbox_id)) not in names  # no key-less pod left
        await backend.close()

    asyncio.run(scenario())


def test_after_a_stale_key_the_pod_another_replica_made_meanwhile_is_adopted_not_deleted(k8s_settings, pod_api, core_api):
    """A stale key Secret makes the create start over; if another replica makes the sandbox's
    pod (with its key) before the new attempt, that attempt's create answers 409 and the pod
    is adopted with the key its Secret holds. It was deleted as key-less: the start-over had
    left "no key" remembered for the pod name (and the other replica's own create then failed)."""
    import asyncio
    import base64
    import secrets

    from orchard.backends.loading import load_backend
    from orchard.models import SandboxSpec
    from orchard_k8s import pods

    api, namespace = core_api, k8s_settings["namespace"]

    async def scenario() -> None:
        backend = load_backend("k8s", k8s_settings)
        await backend.resources()  # the shared watch runs
        spec = SandboxSpec(image=KIT_IMAGE, sandbox_id=f"adopt-{secrets.token_hex(4)}")
        name = manifests.pod_name(str(spec.sandbox_id))
        api.create_namespaced_secret(namespace, manifests.secret_manifest(
            str(spec.sandbox_id), secrets.token_urlsafe(32), backend.config, {"name": "gone", "uid": "0-old-pod"}))
        posts = pod_api.requests[("POST", "pods")]
        pod_api.faults_for[("POST", "pods")] = [None, 409]  # the second attempt finds a pod of that name
        try:
            creating = asyncio.create_task(backend.create(spec))
            while pod_api.requests[("POST", "pods")] < posts + 2:
                await asyncio.sleep(0.01)
            # the other replica's pod and key (blocking calls: both are there before the backend looks)
            theirs = api.create_namespaced_pod(namespace, manifests.pod_manifest(spec, backend.config))
            their_token = secrets.token_urlsafe(32)
            api.create_namespaced_secret(namespace, manifests.secret_manifest(
                str(spec.sandbox_id), their_token, backend.config,
                {"name": theirs.metadata.name, "uid": theirs.metadata.uid}))
            sandbox = await asyncio.wait_for(creating, 90)
        finally:
            pod_api.faults_for.pop(("POST", "pods"), None)
        assert sandbox.status == "ready"
        assert api.read_namespaced_pod(name, namespace).metadata.uid == theirs.metadata.uid  # adopted, not remade
        endpoint = await backend.endpoint(spec.sandbox_id)
        assert endpoint.token == their_token
        assert base64.b64decode(api.read_namespaced_secret(manifests.secret_name(str(spec.sandbox_id)),
                                                           namespace).data["token"]).decode() == their_token
        assert pods.is_ready(backend._watch.pods[name])
        await backend.delete(str(spec.sandbox_id))
        await backend.close()

    asyncio.run(scenario())


def test_a_sandbox_whose_pod_has_not_started_is_deleted_without_asking_its_agent(k8s_settings, pod_api, core_api):
    """A create cut by its replica's death and never asked again leaves a pending record; the
    survivor's reconciler drops it by deleting the sandbox. Its pod had not started (here:
    its creator died before the key Secret, so it never will): there is no agent to ask. The
    delete deleted the pod, then failed 'lost' ("agent ... has no address"), and the
    reconciler logged a failed drop before dropping it on its next round (seen in
    test_two_replicas_k8s.py)."""
    import asyncio
    import secrets

    from orchard.backends.loading import load_backend
    from orchard.models import SandboxSpec

    api, namespace = core_api, k8s_settings["namespace"]

    async def scenario() -> None:
        backend = load_backend("k8s", k8s_settings)
        await backend.resources()  # the shared watch runs
        spec = SandboxSpec(image=KIT_IMAGE, sandbox_id=f"unstarted-{secrets.token_hex(4)}")
        name = manifests.pod_name(str(spec.sandbox_id))
        api.create_namespaced_pod(namespace, manifests.pod_manifest(spec, backend.config))  # the dead server's
        await backend._watch.wait_for(name, lambda pod: pod is not None, 30)
        await backend.delete(str(spec.sandbox_id))
        assert ("pods", namespace, name) not in pod_api.objects
        await backend.close()

    asyncio.run(scenario())
