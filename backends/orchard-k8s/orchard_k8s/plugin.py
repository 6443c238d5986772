"""Registers the Kubernetes backend through the ``orchard`` entry-point group, like any third
party. Imports stay inside the hook: agents load plugins too and need no Kubernetes client."""

from orchard.hookspecs import hookimpl


@hookimpl
def orchard_register_backends(register):
    from orchard_k8s.backend import KubernetesBackend

    register(KubernetesBackend)
