"""seed_everything: the numbers torch.manual_seed and the standard seeds give, from every
generator a step draws from (a live job reseeds each step through the cheaper path)."""

from __future__ import annotations

import random

import numpy as np
import torch

from shoal.runtime.seeds import seed_everything


def _draws() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist(),
            torch.randint(0, 2**31, (2,)).tolist(), torch.nn.functional.dropout(
                torch.ones(8), 0.5).tolist())


def test_seeding_gives_what_torch_manual_seed_gives():
    for seed in (0, 7, 2**40 + 3, 2**63 - 1):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        expected = _draws()
        torch.manual_seed(seed + 1)  # something else in between
        seed_everything(seed)
        assert _draws() == expected
