"""What the GPU tests share: where they run, the small GPT they train, and how a run is
made exact (no TF32, deterministic kernels) where a test compares bits.

Every run here is one process on the first GPU, started by ``shoal.spawn`` (``shoal.init``
holds once per process, and a fresh process takes the environment that cuBLAS reads).
Results come back as CPU tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

import shoal
from shoal.examples import gpt

BACKEND = "nccl"  # one process on the GPU
DEVICE = "cuda"

# Small enough that each run takes seconds; vocab and width divide nothing awkwardly.
GPT = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64, seed=5)
N_TOKENS = 64  # sequences in the token dataset: 8 batches of 8


def make_gpt(device: str = "cpu") -> gpt.GPT:
    return gpt.build_model(**GPT, device=device)


def tokens(n: int = N_TOKENS) -> TensorDataset:
    """Random token ids and their next tokens, the same in every process."""
    ids = torch.randint(0, GPT["vocab_size"], (n, GPT["seq_len"] + 1),
                        generator=torch.Generator().manual_seed(1))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def exact_fp32() -> None:
    """fp32 matmuls and convolutions in fp32, not TF32 (10 bits of mantissa): GPU results
    then differ from the CPU's only by the order of sums."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def deterministic() -> None:
    """The same inputs give the same bits on every run. Call first in a spawned process,
    before CUDA starts: cuBLAS reads its workspace setting when it makes its handle."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    exact_fp32()


def init() -> torch.device:
    """Join a group of one on the GPU; the device the Trainer will use."""
    shoal.init(BACKEND)
    return shoal.device()


def whole_weights(trainer: shoal.Trainer) -> dict[str, torch.Tensor]:
    """The whole model's tensors on the CPU, whatever the strategy (FSDP's are gathered)."""
    state = get_model_state_dict(trainer.state_model,
                                 options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def device_of(trainer: shoal.Trainer) -> str:
    """Where the trained model's parameters live ('cuda', 'cpu')."""
    return next(trainer.module.parameters()).device.type


def recording(losses: list[float], loss_fn=gpt.loss):
    """``loss_fn`` that also appends each micro-batch's loss to ``losses``."""
    def recorded(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = loss_fn(outputs, targets)
        losses.append(value.item())
        return value
    return recorded


def records(directory: str | Path, kind: str) -> list[dict]:
    """The records of one type ('step', 'ranks') of a run's metrics.jsonl."""
    lines = (Path(directory) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit the same tensors under the same names."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
