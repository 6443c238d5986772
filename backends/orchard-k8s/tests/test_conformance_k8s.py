"""The shared backend conformance suite against the k8s backend, through the real
``kubernetes`` client and the Pod-API test server (a test double: see pod_api_server.py;
its kubelet enforces pod limits with cgroups and sizes the writable directories by the
pod's ephemeral-storage limit, where a real kubelet evicts the pod instead)."""

from orchard.testing.conformance import *  # noqa: F401,F403

orchard_backends = ["k8s"]
