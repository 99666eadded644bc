"""Weights from outside a run (``trainer.init_from``): a safetensors or torch file of a
model's ``state_dict`` (``shoal export``), a Hugging Face model directory, or a shoal
checkpoint's model; read on every rank, on the CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.checkpoint.layout import COMMIT, STEP_DIR
from shoal.errors import UsageError

_HF_FILES = ("model.safetensors", "pytorch_model.bin")


def read_state_dict(source: str | Path) -> dict[str, torch.Tensor]:
    """The model weights ``source`` holds, by name.

    Raises:
        UsageError: If it holds none of the forms above (the message says which it
            looked for), or a safetensors file without the safetensors package.
    """
    path = Path(source)
    if path.is_dir():
        if (path / COMMIT).is_file() or STEP_DIR.match(path.name) or any(
                STEP_DIR.match(p.name) for p in path.iterdir()):
            from shoal.checkpoint.export import checkpoint_of, read_weights

            return read_weights(checkpoint_of(path))
        found = next((path / name for name in _HF_FILES if (path / name).is_file()), None)
        if found is None:
            raise UsageError(f"init_from {path}: no {' or '.join(_HF_FILES)} in it, and no "
                             "shoal checkpoint (sharded Hugging Face weights: merge them "
                             "first)")
        path = found
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UsageError(f"init_from {path}: reading safetensors needs the safetensors "
                             "package (pip install safetensors)") from None
        return load_file(str(path))
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor)
                                               for v in loaded.values()):
        raise UsageError(f"init_from {path}: not a state_dict (a mapping of names to "
                         "tensors)")
    return loaded
