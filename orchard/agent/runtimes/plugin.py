"""Built-in isolation runtimes, registered the way a plugin registers its own."""

from orchard.agent.runtimes.bwrap import BwrapRuntime
from orchard.agent.runtimes.direct import DirectRuntime
from orchard.hookspecs import hookimpl


@hookimpl
def orchard_register_runtimes(register):
    register(BwrapRuntime)
    register(DirectRuntime)
