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

from shoal.parallel.comm import Comm
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


def sum_of_selections(rows: torch.Tensor, like: torch.Tensor, divisor: int) -> torch.Tensor:
    """The mean of every rank's selection: ``rows`` (one per rank: its values' bytes, then
    their int32 positions' bytes), scattered into zeros shaped and typed like ``like``
    (the flat gradient), summed in rank order and divided by ``divisor``."""
    total = torch.zeros_like(like)
    k = rows.shape[1] // (like.element_size() + 4)
    n_value_bytes = k * like.element_size()
    for chunk in rows:
        total.index_add_(0, _read_as(chunk[n_value_bytes:], torch.int32).long(),
                         _read_as(chunk[:n_value_bytes], like.dtype))
    total /= divisor
    return total


def _read_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``raw`` (1-d) as ``dtype``; copied first where they do not start at a
    multiple of its size (a row of 16-bit values whose count is odd)."""
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


class TopKHook(Comm):
    """State and hook: ``model.register_comm_hook(state, TopKHook.hook)``."""

    def __init__(self, model: nn.Module, ratio: float, traffic: Traffic,
                 group: dist.ProcessGroup | None = None):
        self.ratio = ratio
        self.traffic = traffic
        self.group = group
        self.names: dict[torch.Tensor, str] = {p: name for name, p in model.named_parameters()}
        # The model's order: the selection, and every rank's positions, follow it, whatever
        # the order of DDP's buckets.
        self._order: dict[torch.Tensor, int] = {p: i for i, p in enumerate(model.parameters())}
        self.residuals: dict[str, torch.Tensor] = {}  # error feedback, per parameter
        self._held: list[tuple[dist.GradBucket, torch.futures.Future]] = []

    def numel(self) -> int:
        """The entries of the gradient a step selects from (every trained parameter's)."""
        return sum(p.numel() for p in self._order if p.requires_grad)

    def payload_bytes(self, dtype: torch.dtype) -> int:
        """The bytes of a rank's message: ``k`` values of ``dtype`` and their int32
        positions."""
        k = max(1, int(self.numel() * self.ratio))
        return k * (torch.empty((), dtype=dtype).element_size() + 4)

    @staticmethod
    def hook(state, bucket):  # no annotations: DDP checks them literally
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        state._held.append((bucket, future))
        if bucket.is_last():  # DDP hands buckets over in order; this one closes the step
            state._exchange()
        return future

    def _exchange(self) -> None:
        held, self._held = self._held, []
        grads = sorted(((p, g) for bucket, _ in held
                        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)),
                       key=lambda pair: self._order[pair[0]])
        flat = torch.cat([g.reshape(-1) for _, g in grads])
        pending = [r.reshape(-1) for p, _ in grads
                   if (r := self.residuals.get(self.names[p])) is not None]
        if len(pending) == len(grads):
            flat += torch.cat(pending)
        elif pending:
            raise RuntimeError("top-k residuals cover only part of the model")
        k = max(1, int(flat.numel() * self.ratio))
        positions, values, residual = select(flat, k)
        spans: dict[torch.Tensor, slice] = {}
        offset = 0
        for p, g in grads:
            spans[p] = slice(offset, offset + g.numel())
            self.residuals[self.names[p]] = residual[spans[p]].view_as(g)
            offset += g.numel()
        # One message per rank: the values' bytes, then the int32 positions' bytes.
        payload = torch.cat([values.view(torch.uint8),
                             positions.to(torch.int32).view(torch.uint8)])
        rows, divisor = self._gather(payload)

        def finish(gathered: torch.futures.Future[torch.Tensor]) -> None:
            try:  # (value() raises if the gather failed)
                total = sum_of_selections(gathered.value(), flat, divisor)
                for bucket, future in held:
                    # Into the bucket's own buffer: DDP reads a result from its storage's
                    # start.
                    buffer = bucket.buffer()
                    buffer.copy_(torch.cat([total[spans[p]] for p in bucket.parameters()]))
                    future.set_result(buffer)
            except Exception as exc:  # noqa: BLE001 - handed to DDP, which raises it
                for _, future in held:
                    if not future.done():
                        future.set_exception(exc)

        rows.then(finish)

    def _gather(self, payload: torch.Tensor
                ) -> tuple[torch.futures.Future[torch.Tensor], int]:
        """Every rank's ``payload`` (a future of a (ranks, bytes) tensor), and what their
        sum is divided by."""
        world = dist.get_world_size(self.group)
        if world == 1:  # one process: nothing to gather
            return _done(payload.view(1, -1)), 1
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8,
                               device=payload.device)
        self.traffic.sent(all_gather_bytes(payload.numel(), world))
        self.traffic.launched()

        def rows(future: torch.futures.Future) -> torch.Tensor:
            self.traffic.done()
            future.value()  # raises if the all-gather failed
            return gathered.view(world, -1)

        work = gather_into_tensor(gathered, payload, group=self.group, async_op=True)
        return work.get_future().then(rows), world

    def state_dict(self) -> dict:
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(value)
    return future
