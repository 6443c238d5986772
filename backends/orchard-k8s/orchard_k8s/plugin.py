"""Registers the Kubernetes backend and its ``orchard bench k8s`` through the ``orchard``
entry-point group, like any third party. Imports stay inside the hooks: agents load plugins
too and need no Kubernetes client."""

from orchard.hookspecs import hookimpl


@hookimpl
def orchard_register_backends(register):
    from orchard_k8s.backend import KubernetesBackend

    register(KubernetesBackend)


@hookimpl
def orchard_add_commands(cli):
    from orchard_k8s.cli import bench_k8s

    cli.commands["bench"].add_command(bench_k8s)
