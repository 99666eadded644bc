"""``RemoteModule``: an nn.Module whose forward and backward run on a remote tier.

It stands in for a local module and holds that module's parameters and buffers under the
same names, so the trainer owns them as it owns every other parameter: data parallelism
all-reduces their gradients, the optimizer updates them, gradient clipping sees them, and
checkpoints hold them (a checkpoint of the all-local model loads into the remote one and the
reverse). The tier computes with a copy that it is sent whenever the parameters changed
(after each optimizer step).

The calls: 'forward' sends ``in.<i>`` (and ``param.<name>`` / ``buffer.<name>`` when they
changed) and gets ``out.<i>`` (and the buffers after a training forward); 'backward' sends
``gout.<i>`` for the forward's request id and gets ``gin.<i>`` and ``gparam.<name>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shoal.errors import UsageError
from shoal.remote import tier as tiers
from shoal.remote.tier import NeedsState, RemoteTier, RemoteTierError
from shoal.runtime.heartbeat import last_step

if TYPE_CHECKING:
    from collections.abc import Iterable

_bound: set[int] = set()


class RemoteModule(nn.Module):
    """Runs ``module`` on ``tier`` (default: the run's tier, ``shoal.remote.current()``).
    ``module`` gives the parameters (their initial values are used, so a model builds the
    same with its block local or remote); its own forward is never called here.

    Raises:
        UsageError: If no tier is given and the run has none, the tier already runs another
            RemoteModule, or the module it serves has other parameters or buffers than
            ``module``.
        RemoteTierError: If the tier cannot say what it serves (server unreachable, token
            refused, no reply within ``deadline_s``).
    """

    _single: bool  # whether the last forward's module returned one tensor (set by _RemoteCall)

    def __init__(self, module: nn.Module, tier: RemoteTier | None = None):
        super().__init__()
        self.tier = tier if tier is not None else tiers.current()
        if id(self.tier) in _bound:
            raise UsageError(f"remote tier {self.tier.endpoint} already runs another "
                             "RemoteModule: a server holds one module; start one per block")
        # The stand-in's parameters, buffers and submodules are the module's, by name.
        for slot in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            setattr(self, slot, getattr(module, slot))
        self.module_name = type(module).__name__
        self._check(self.tier.capabilities())
        _bound.add(id(self.tier))
        self._owns_tier = True
        self._sent: tuple | None = None
        self.forwards = 0

    def __del__(self) -> None:
        if getattr(self, "_owns_tier", False):
            _bound.discard(id(self.tier))

    def _check(self, served: tiers.Capabilities) -> None:
        def spec(tensors: Iterable[tuple[str, torch.Tensor]]
                 ) -> dict[str, tuple[list[int], str]]:
            return {n: (list(t.shape), str(t.dtype).removeprefix("torch."))
                    for n, t in tensors}
        mine = {"parameters": spec(self.named_parameters()),
                "buffers": spec(self.named_buffers())}
        for kind in ("parameters", "buffers"):
            theirs = {n: (list(s), d) for n, (s, d) in getattr(served, kind).items()}
            if mine[kind] != theirs:
                differ = sorted(set(mine[kind]) ^ set(theirs)) or sorted(
                    n for n in mine[kind] if mine[kind][n] != theirs[n])
                raise UsageError(f"remote tier {self.tier.endpoint} serves {served.module}, "
                                 f"whose {kind} differ from the local {self.module_name}'s: "
                                 f"{', '.join(differ[:4])}")

    def extra_repr(self) -> str:
        return f"tier={self.tier.endpoint}"

    # -- state -------------------------------------------------------------------------

    def _versions(self) -> tuple:
        return tuple((t.data_ptr(), t._version) for t in
                     (*self.parameters(), *self.buffers()))

    def _state(self) -> dict[str, torch.Tensor]:
        return {**{f"param.{n}": p.detach() for n, p in self.named_parameters()},
                **{f"buffer.{n}": b for n, b in self.named_buffers()}}

    def tier_state(self) -> dict[str, Any]:
        return self.tier.state_dict()

    def load_tier_state(self, state: dict[str, Any]) -> None:
        self.tier.load_state_dict(state)
        self._sent = None

    # -- calls -------------------------------------------------------------------------

    def remote_forward(self, inputs: tuple[torch.Tensor, ...], grad: bool
                       ) -> tuple[str, list[torch.Tensor], bool]:
        """Run forward remotely; returns its request id, the outputs and whether a single
        tensor came back.

        Raises:
            RemoteTierError: If the call fails (see ``RemoteTier``); a server that lost the
                module's state (``NeedsState``) is sent it again first, once.
        """
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor)),
                      torch.device("cpu"))
        autocast = None
        if torch.is_autocast_enabled(device.type):
            autocast = str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")
        meta = {"inputs": len(inputs), "grad": grad, "training": self.training,
                "autocast": autocast}
        tensors = {f"in.{i}": t for i, t in enumerate(inputs)}
        self.forwards += 1
        step = last_step() + 1
        versions = self._versions()
        send_state = versions != self._sent
        try:
            header, reply = self.tier.call("forward", {**tensors, **(
                self._state() if send_state else {})}, meta=meta, step=step)
        except NeedsState:  # a new server process: it gets the state once more
            header, reply = self.tier.call("forward", {**tensors, **self._state()},
                                           meta=meta, step=step)
        self._sent = versions
        buffers = {k.removeprefix("buffer."): v for k, v in reply.items()
                   if k.startswith("buffer.")}
        if buffers:
            with torch.no_grad():
                for name, buffer in self.named_buffers():
                    buffer.copy_(buffers[name])
            self._sent = self._versions()
        outputs = [reply[f"out.{i}"].to(device) for i in range(header["outputs"])]
        return header.get("request_id", ""), outputs, header["single"]

    def remote_backward(self, forward_id: str, grads: tuple[torch.Tensor, ...]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        _, reply = self.tier.call("backward", {f"gout.{i}": g for i, g in enumerate(grads)},
                                  meta={"forward_id": forward_id}, step=last_step() + 1)
        grad_inputs = {k.removeprefix("gin."): v for k, v in reply.items()
                       if k.startswith("gin.")}
        grad_params = {k.removeprefix("gparam."): v for k, v in reply.items()
                       if k.startswith("gparam.")}
        return grad_inputs, grad_params

    def forward(self, *inputs: torch.Tensor) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params)
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs))
        if not grad:
            _, outputs, single = self.remote_forward(inputs, grad=False)
        else:
            outputs = _RemoteCall.apply(self, len(inputs), *inputs, *params)
            single = self._single
        return outputs[0] if single else tuple(outputs)


class _RemoteCall(torch.autograd.Function):
    """Autograd's view of a remote call: activations out in forward, gradients back in
    backward, for the inputs and for the module's parameters."""

    @staticmethod
    def forward(ctx: Any, remote: RemoteModule, n_inputs: int, *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        inputs = tensors[:n_inputs]
        forward_id, outputs, single = remote.remote_forward(inputs, grad=True)
        remote._single = single
        ctx.remote, ctx.forward_id = remote, forward_id
        ctx.inputs_meta = [(t.device, t.dtype) if isinstance(t, torch.Tensor) else None
                           for t in inputs]
        ctx.names = [n for n, p in remote.named_parameters() if p.requires_grad]
        ctx.params_meta = [(p.device, p.dtype) for p in tensors[n_inputs:]]
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_inputs, grad_params = ctx.remote.remote_backward(ctx.forward_id, grads)
        ins = [grad_inputs[str(i)].to(*meta) if str(i) in grad_inputs and meta else None
               for i, meta in enumerate(ctx.inputs_meta)]
        params = [grad_params[name].to(*meta) if name in grad_params else None
                  for name, meta in zip(ctx.names, ctx.params_meta, strict=True)]
        return (None, None, *ins, *params)


def remote_modules(model: nn.Module) -> dict[str, RemoteModule]:
    """The model's remote modules by qualified name.

    Never raises.
    """
    return {n: m for n, m in model.named_modules() if isinstance(m, RemoteModule)}


__all__ = ["RemoteModule", "RemoteTierError", "remote_modules"]
