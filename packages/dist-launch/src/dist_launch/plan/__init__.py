"""What one run does: its plan, resolved from flags, ``PET_*``, SLURM and Kubernetes variables."""
