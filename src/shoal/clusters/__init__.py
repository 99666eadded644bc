"""Cluster knowledge: the scheduler's topology from the environment (SLURM, Open MPI,
Kubernetes, torchrun), hostlists, and the SLURM and Kubernetes job files `shoal` writes."""
