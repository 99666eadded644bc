"""Handwritten digits (8x8, 1797 images, shipped with scikit-learn): data and an MLP."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_data(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation splits; pixels scaled to [0, 1]. Needs no download."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def build_model(hidden: int = 128, seed: int = 0) -> nn.Module:
    """A two-hidden-layer MLP, 64 pixels to 10 classes, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )
