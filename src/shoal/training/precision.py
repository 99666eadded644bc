"""Mixed precision: the autocast context and gradient scaling, chosen by name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

_AUTOCAST_DTYPE = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


class Precision:
    """Hooks around forward, backward and the optimizer step for one precision setting."""

    def __init__(self, name: str, device: torch.device, sharded: bool = False):
        self.name = name
        self.device = device
        self.dtype = _AUTOCAST_DTYPE.get(name)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range.
        self.scaler = None
        if name == "fp16-mixed":
            # Sharded gradients: an overflow in one rank's shard must skip the step on all.
            self.scaler = ShardedGradScaler(device.type) if sharded \
                else torch.amp.GradScaler(device.type)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skips the step when gradients overflowed
        self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
