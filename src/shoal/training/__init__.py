"""Training: precision, the piecewise Harness, and the Trainer built on it."""
