"""Registers the Slurm backend through the ``orchard`` entry-point group, like any third party."""

from orchard.hookspecs import hookimpl


@hookimpl
def orchard_register_backends(register):
    from orchard_slurm.backend import SlurmBackend

    register(SlurmBackend)
