"""The process's random number generators: Python's, numpy's and torch's, seeded together
(``shoal.checkpoint.rng`` reads and puts back their states)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch RNGs of this process.

    Raises:
        ValueError: If ``seed`` is below ``-2**63`` or above ``2**64 - 1`` (torch's range).
    """
    # Without torch.manual_seed's queued CUDA call where it is not needed: it records a
    # traceback each time (about 0.1 to 1 ms: a live job reseeds every step).
    seed_cpu(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    elif torch.accelerator.is_available():
        torch.manual_seed(seed)  # also queued for an accelerator not yet in use


def seed_cpu(seed: int) -> None:
    """Seed python's, numpy's and torch's CPU generators (about 6 us)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
