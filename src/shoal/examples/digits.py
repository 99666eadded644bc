"""Handwritten digits (8x8, 1797 images, shipped with scikit-learn): data and an MLP."""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shoal.extras import needs, require


@needs("examples")
def build_data(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation splits; pixels scaled to [0, 1]. Needs no download."""
    pixels, labels = load_digits()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 images (pixels 0..16, one row of 64 each) and their labels, as scikit-learn's
    ``load_digits`` gives them. The file scikit-learn ships is read directly: importing
    scikit-learn costs about a second in every worker."""
    require("examples", "the digits data (shipped with scikit-learn)")
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") \
        if spec is not None and spec.origin else ""
    if not os.path.isfile(path):  # another layout: ask scikit-learn itself
        from sklearn.datasets import load_digits as sklearn_digits

        digits = sklearn_digits()
        return digits.data, digits.target
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def build_model(hidden: int = 128, seed: int = 0) -> nn.Module:
    """A two-hidden-layer MLP, 64 pixels to 10 classes, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )
