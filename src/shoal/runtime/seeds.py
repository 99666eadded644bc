"""The process's random number generators: Python's, numpy's and torch's, seeded together,
and their states read and put back together."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch RNGs of this process.

    Raises:
        ValueError: If ``seed`` is below ``-2**63`` or above ``2**64 - 1`` (torch's range).
    """
    if torch.accelerator.is_available() and not torch.cuda.is_initialized():
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # also queued for an accelerator not yet in use
        return
    # The same seeds without torch.manual_seed's queued CUDA call, which records a
    # traceback each time (about 0.1 to 1 ms: a live job reseeds every step).
    seed_cpu(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def seed_cpu(seed: int) -> None:
    """Seed python's, numpy's and torch's CPU generators (about 6 us)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)


def rng_states() -> tuple[Any, Any, torch.Tensor]:
    """The states of Python's, numpy's and torch's (CPU) generators."""
    return random.getstate(), np.random.get_state(), torch.default_generator.get_state()


def set_rng_states(states: tuple[Any, Any, torch.Tensor]) -> None:
    """Put back what ``rng_states`` read."""
    python, numpy, cpu = states
    random.setstate(python)
    np.random.set_state(numpy)
    torch.default_generator.set_state(cpu)


def same_rng_states(a: tuple[Any, Any, torch.Tensor], b: tuple[Any, Any, torch.Tensor]
                    ) -> bool:
    """Whether two ``rng_states`` are the same (nothing was drawn between them)."""
    return (a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1], strict=True))
            and torch.equal(a[2], b[2]))
