"""HPC container runtimes for the exec agent (registered by ``orchard_slurm.plugin``)."""
