"""The Slurm backend: sandboxes inside pilot jobs (an exec agent each) on a Slurm cluster."""
