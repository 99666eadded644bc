"""A live dashboard of shoal runs: every rank of a running job, in a browser."""
