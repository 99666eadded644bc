"""Out of shoal: a checkpoint's model weights as one file of full tensors, or a Hugging Face
model directory (`shoal export CHECKPOINT OUT --format safetensors|torch|hf`).

Any strategy's checkpoint (ddp, zero1/2, fsdp, tp, pp, 2-D; local_sgd and diloco: rank 0's
replica) holds the model under the unwrapped model's parameter names, sharded or not: each
tensor is read whole by DCP, one at a time, in one process and without a process group,
and the file is keyed as the model's ``state_dict``. Peak memory: about the model's size
plus the tensor being read.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp

from shoal.checkpoint.layout import STEP_DIR, problem
from shoal.checkpoint.store import CheckpointError, CheckpointStore, read_info, tensor_targets
from shoal.errors import UsageError

Format = Literal["safetensors", "torch", "hf"]
FORMATS: tuple[Format, ...] = ("safetensors", "torch", "hf")


def checkpoint_of(source: str | Path) -> Path:
    """``source`` itself when it is a checkpoint (step_N), else the newest complete one in
    it (a checkpoint_dir).

    Raises:
        CheckpointError: If it is neither, or the checkpoint is incomplete.
    """
    path = Path(source)
    if STEP_DIR.match(path.name) is None and path.is_dir():
        latest = CheckpointStore(path).latest(report=False)
        if latest is None:
            raise CheckpointError(f"{path}: no complete checkpoint in it")
        path = latest
    why = problem(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} cannot be exported: {why}")
    return path


def model_keys(path: Path) -> dict[str, str]:
    """The model's parameter and buffer names in the checkpoint at ``path``, each with the
    key DCP stored it under."""
    info = read_info(path)
    assert info is not None  # (a complete checkpoint: checkpoint_of says so)
    part = _entry(info["shared"], "model") or _entry((info["ranks"] or [None])[0], "model")
    if part is None:
        raise CheckpointError(f"checkpoint {path} holds no model")
    return {name: node["__tensor__"] for name, node in part["__dict__"]
            if isinstance(node, dict) and "__tensor__" in node}


def _entry(skeleton: Any, name: str) -> Any:
    if not isinstance(skeleton, dict) or "__dict__" not in skeleton:
        return None
    return next((node for key, node in skeleton["__dict__"] if key == name), None)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors, by name, read one at a time (no process group)."""
    keys = model_keys(path)
    # (allocated now, filled one at a time: a page counts once DCP writes it)
    targets = tensor_targets(path, list(keys.values()))
    for key in keys.values():
        with warnings.catch_warnings():  # (DCP says it loads in one process: it does)
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load({key: targets[key]}, checkpoint_id=str(path), no_dist=True)
    return {name: targets[key] for name, key in keys.items()}


def export(source: str | Path, out: str | Path, format: Format = "safetensors") -> Path:
    """Write the weights of the checkpoint ``source`` names to ``out``: a .safetensors or
    torch file, or under 'hf' a ``save_pretrained`` directory (the run's ``model.hf``).
    Returns the checkpoint exported.

    Raises:
        CheckpointError: If ``source`` names no complete checkpoint, or it holds no model.
        UsageError: If ``format`` is unknown, its package is missing, or 'hf' is asked of
            a run whose model is not a transformers model.
    """
    if format not in FORMATS:
        raise UsageError(f"--format {format}: one of {', '.join(FORMATS)}")
    path = checkpoint_of(source)
    spec = _hf_spec(path) if format == "hf" else None
    weights = read_weights(path)
    out = Path(out)
    if format == "torch":
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(weights, out)
    elif format == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise UsageError("--format safetensors needs the safetensors package: pip "
                             "install safetensors (or --format torch)") from None
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out), metadata={"format": "pt"})
    else:
        from shoal.models.hf import build_config, model_class

        assert spec is not None  # asked for first, under 'hf'
        cls = model_class(spec.model_class)
        with torch.device("meta"):
            model = cls(build_config(cls, spec.config))
        model.load_state_dict(weights, assign=True, strict=False)
        model.tie_weights()  # type: ignore[operator]  # (transformers' PreTrainedModel)
        model.save_pretrained(str(out))  # type: ignore[operator]
    return path


def _hf_spec(path: Path) -> Any:
    from shoal.models.hf import HFModelConfig

    meta = (read_info(path) or {"meta": {}})["meta"]
    hf = ((meta.get("run_config") or {}).get("model") or {}).get("hf")
    if not hf:
        raise UsageError(f"--format hf: the run of {path} has no transformers model "
                         "(model.hf in its run config); use --format safetensors or torch")
    return HFModelConfig(**hf)
