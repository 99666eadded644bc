"""Every random number generator of a process, captured and restored as tensors."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def capture() -> dict[str, torch.Tensor]:
    """torch (CPU and each CUDA device), numpy and python RNG states, as tensors only."""
    version, words, gauss = random.getstate()
    # numpy's stub gives the dict of legacy=False; the default (legacy) is the tuple
    kind, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray[Any, Any], int, int, float]",
                                              np.random.get_state())
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *words], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss,
                                      float(gauss is not None)], dtype=torch.float64),
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_extra": torch.tensor([pos, has_gauss, cached], dtype=torch.float64),
    }
    assert kind == "MT19937"
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{i}"] = s
    return state


def restore(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    version, *words = state["python"].tolist()
    gauss, has_gauss = state["python_gauss"].tolist()
    random.setstate((version, tuple(words), gauss if has_gauss else None))
    pos, has, cached = state["numpy_extra"].tolist()
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), int(pos),
                         int(has), cached))
    for key, value in state.items():
        if key.startswith("cuda") and torch.cuda.is_available():
            index = int(key[4:])
            if index < torch.cuda.device_count():
                torch.cuda.set_rng_state(value, index)
