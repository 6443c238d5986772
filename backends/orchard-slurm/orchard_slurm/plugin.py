"""Registers the Slurm backend, its container runtimes and its ``orchard bench slurm`` through the ``orchard``
entry-point group, like any third party. Imports stay inside the hooks: agents load plugins too."""

from orchard.hookspecs import hookimpl


@hookimpl
def orchard_register_backends(register):
    from orchard_slurm.backend import SlurmBackend

    register(SlurmBackend)


@hookimpl
def orchard_register_runtimes(register):
    from orchard_slurm.runtimes.apptainer import ApptainerRuntime
    from orchard_slurm.runtimes.charliecloud import CharliecloudRuntime
    from orchard_slurm.runtimes.podman import PodmanRuntime

    register(ApptainerRuntime)
    register(CharliecloudRuntime)
    register(PodmanRuntime)


@hookimpl
def orchard_add_commands(cli):
    from orchard_slurm.cli import bench_slurm, slurm_group

    cli.commands["bench"].add_command(bench_slurm)
    cli.add_command(slurm_group)
