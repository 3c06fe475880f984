"""What one run does: its plan, resolved from flags, ``PET_*`` variables and SLURM."""
