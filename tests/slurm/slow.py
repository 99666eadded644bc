"""The digits data, optionally slowed down per sample, so that a test can signal or kill a
job while it trains. The samples and their order are the digits example's."""

from __future__ import annotations

import time

from torch.utils.data import Dataset

from shoal.examples import digits


class Slowed(Dataset):
    def __init__(self, base: Dataset, delay: float):
        self.base, self.delay = base, delay

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        if self.delay:
            time.sleep(self.delay)
        return self.base[index]


def build_data(delay: float = 0.0, **kwargs) -> tuple[Dataset, Dataset]:
    """digits.build_data(**kwargs), the training split taking ``delay`` seconds a sample."""
    train, val = digits.build_data(**kwargs)
    return Slowed(train, delay), val
