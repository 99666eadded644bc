"""A remote tier plugin of our own for the tests: the module runs in this process, with no
network, behind the same ``RemoteTier`` methods (proof that RemoteModule needs nothing
else of a tier)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from shoal.remote import Capabilities, RemoteConfig
from tests.remote.blocks import block


class InProcessTier:
    def __init__(self, config: RemoteConfig):
        self.endpoint = f"in-process:{config.endpoint}"
        self.module = block(**config.args)
        self.pending: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.ids = itertools.count()
        self.restored: dict[str, Any] | None = None

    def capabilities(self) -> Capabilities:
        def spec(tensors):
            return {n: (list(t.shape), str(t.dtype).removeprefix("torch."))
                    for n, t in tensors}
        return Capabilities("tests.remote.blocks:block", "cpu", torch.__version__,
                            spec(self.module.named_parameters()),
                            spec(self.module.named_buffers()))

    def healthy(self) -> bool:
        return True

    def call(self, op, tensors, *, meta, step, deadline_s=None):
        request_id = str(next(self.ids))
        if op == "forward":
            with torch.no_grad():
                for name, p in self.module.named_parameters():
                    if f"param.{name}" in tensors:
                        p.copy_(tensors[f"param.{name}"])
            inputs = [tensors[f"in.{i}"].detach().clone().requires_grad_(meta["grad"])
                      for i in range(meta["inputs"])]
            with torch.set_grad_enabled(meta["grad"]):
                out = self.module(*inputs)
            self.pending[request_id] = (inputs, [out])
            return ({"outputs": 1, "single": True, "request_id": request_id},
                    {"out.0": out.detach()})
        inputs, outs = self.pending.pop(meta["forward_id"])
        self.module.zero_grad(set_to_none=True)
        torch.autograd.backward(outs, [tensors["gout.0"]])
        reply = {"gin.0": inputs[0].grad}
        reply.update({f"gparam.{n}": p.grad for n, p in self.module.named_parameters()})
        return {"request_id": request_id}, reply

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "in-process"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state

    def close(self) -> None:
        self.pending.clear()


def factory(config: RemoteConfig) -> InProcessTier:
    return InProcessTier(config)


def broken(config: RemoteConfig) -> object:
    return object()
