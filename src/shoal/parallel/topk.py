"""Top-k gradient sparsification with error feedback, as a DDP communication hook.

Each rank sends only the ``ratio`` largest-magnitude entries of its gradient (values and
int32 positions, through one all-gather) and keeps the rest as a residual that is added to
its next gradient, so nothing is lost, only delayed. The selection is over the whole model's
gradient, not per bucket: DDP regroups its buckets after the first step (and again after a
resume), and a model-wide choice does not depend on how the buckets are cut. The hook
therefore holds back every bucket until the last one arrives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shoal.parallel.traffic import Traffic, all_gather_bytes
from shoal.runtime.collectives import gather_into_tensor


def select(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, values, residual) of the ``k`` largest |entries| of ``flat``.

    ``values`` scattered at ``positions`` plus ``residual`` is ``flat`` exactly.
    """
    positions = flat.abs().topk(k, sorted=False).indices
    values = flat[positions]
    residual = flat.clone()
    residual[positions] = 0
    return positions, values, residual


class TopKHook:
    """State and hook: ``model.register_comm_hook(state, TopKHook.hook)``."""

    def __init__(self, model: nn.Module, ratio: float, traffic: Traffic,
                 group: dist.ProcessGroup | None = None):
        self.ratio = ratio
        self.traffic = traffic
        self.group = group
        self.names: dict[torch.Tensor, str] = {p: name for name, p in model.named_parameters()}
        self.residuals: dict[str, torch.Tensor] = {}  # error feedback, per parameter
        self._held: list[tuple[dist.GradBucket, torch.futures.Future]] = []

    @staticmethod
    def hook(state, bucket):  # no annotations: DDP checks them literally
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        state._held.append((bucket, future))
        if bucket.is_last():  # DDP hands buckets over in order; this one closes the step
            state._exchange()
        return future

    def _exchange(self) -> None:
        held, self._held = self._held, []
        grads = [(self.names[p], g) for bucket, _ in held
                 for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)]
        flat = torch.cat([g.reshape(-1) for _, g in grads])
        pending = [r.reshape(-1) for name, _ in grads if (r := self.residuals.get(name))
                   is not None]
        if len(pending) == len(grads):
            flat += torch.cat(pending)
        elif pending:
            raise RuntimeError("top-k residuals cover only part of the model")
        k = max(1, int(flat.numel() * self.ratio))
        positions, values, residual = select(flat, k)
        offset = 0
        for name, g in grads:
            self.residuals[name] = residual[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
        # One message per rank: the values' bytes, then the int32 positions' bytes.
        payload = torch.cat([values.view(torch.uint8),
                             positions.to(torch.int32).view(torch.uint8)])
        world = dist.get_world_size(self.group)
        gathered = payload if world == 1 else torch.empty(  # one process: nothing to gather
            world * payload.numel(), dtype=torch.uint8, device=flat.device)
        self.traffic.sent(all_gather_bytes(payload.numel(), world))
        self.traffic.launched()
        n_value_bytes = values.numel() * values.element_size()

        def finish() -> None:
            self.traffic.done()
            total = torch.zeros_like(flat)
            for chunk in gathered.view(world, -1):
                got_values = chunk[:n_value_bytes].view(flat.dtype)
                got_positions = chunk[n_value_bytes:].view(torch.int32).long()
                total.index_add_(0, got_positions, got_values)
            total /= world
            offset = 0
            for bucket, future in held:
                # Into the bucket's own buffer: DDP reads a result from its storage's start.
                buffer = bucket.buffer()
                buffer.copy_(total[offset:offset + buffer.numel()])
                future.set_result(buffer)
                offset += buffer.numel()

        def scatter(gathered_future: torch.futures.Future) -> None:
            try:
                gathered_future.value()  # raises if the all-gather failed
                finish()
            except Exception as exc:  # noqa: BLE001 - handed to DDP, which raises it
                for _, future in held:
                    if not future.done():
                        future.set_exception(exc)

        if world == 1:
            finish()
            return
        work = gather_into_tensor(gathered, payload, group=self.group, async_op=True)
        work.get_future().then(scatter)

    def state_dict(self) -> dict:
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
