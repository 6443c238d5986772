"""One Kubernetes API call's retries, on a connection that fails without an answer (urllib3's
ProtocolError: a pooled keep-alive connection the API server closed). Seen in CI as a 500
``internal error (ProtocolError)`` for a create under load."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from urllib3.exceptions import ProtocolError

from orchard.errors import BackendUnavailable
from orchard_k8s.backend import KubernetesBackend


def flaky(failures: int):
    calls = []

    def method(*args, **kwargs):
        calls.append(args)
        if len(calls) <= failures:
            raise ProtocolError("Connection aborted.", ConnectionResetError(104, "Connection reset by peer"))
        return "made"
    return method, calls


def call(method, retries: int):
    backend = SimpleNamespace(config=SimpleNamespace(api_retries=retries), api_calls=0)
    return asyncio.run(KubernetesBackend._call(backend, method, "orchard-test"))


def test_a_dropped_connection_is_retried():
    method, calls = flaky(2)
    assert call(method, retries=3) == "made"
    assert len(calls) == 3


def test_a_connection_that_keeps_failing_is_a_retryable_503_not_a_500():
    method, calls = flaky(10)
    with pytest.raises(BackendUnavailable, match="Kubernetes API unreachable") as caught:
        call(method, retries=2)
    assert len(calls) == 3
    assert caught.value.status_code == 503 and caught.value.retryable
