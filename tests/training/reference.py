"""The single-process reference every data-parallel result is compared against.

Plain torch, no shoal, no process group: one process trains on the global batch. The data
order is torch's DistributedSampler rule for one replica: randperm seeded with seed + epoch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

N_SAMPLES = 240  # divisible by 1, 2, 3 and by every global batch used below
SEED = 7


def make_dataset(n: int = N_SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 10, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def reference_weights(global_batch: int, steps: int, seed: int = SEED,
                      n_samples: int = N_SAMPLES) -> dict[str, torch.Tensor]:
    """Weights after ``steps`` SGD steps on batches of ``global_batch`` in one process.

    The epoch's last batch is whatever is left (shorter), as with drop_last=False.
    """
    dataset = make_dataset(n_samples)
    x, y = dataset.tensors
    model = make_model()
    opt = make_optimizer(model)
    step, epoch = 0, 0
    while True:
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        for k in range(-(-len(x) // global_batch)):
            idx = perm[k * global_batch:(k + 1) * global_batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == steps:
                return {k: v.detach().clone() for k, v in model.state_dict().items()}
        epoch += 1
