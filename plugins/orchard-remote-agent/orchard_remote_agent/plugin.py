"""The entry point Orchard loads (``[project.entry-points.orchard]``)."""

from orchard import hookimpl
from orchard_remote_agent.backend import RemoteAgentBackend


@hookimpl
def orchard_register_backends(register):
    register(RemoteAgentBackend)
