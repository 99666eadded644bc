"""A Trainer's validation: loss and accuracy over the whole validation set, on all ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shoal.data.sharding import lockstep_batches
from shoal.runtime.heartbeat import heartbeat
from shoal.training.batches import is_pair, loss_of, model_loss, pipeline_pair, samples_in

Trainer = Any  # a shoal.Trainer (not imported: its module imports this one)


@torch.no_grad()
def validate(t: Trainer, val_data: Dataset | DataLoader) -> dict[str, float]:
    """Loss (and accuracy for class targets) over the whole validation set, all ranks."""
    h = t.harness
    module = t.module
    was_training = module.training
    module.eval()
    # loss * n, correct, n, batches not of class targets: summed over ranks, so the
    # mean weights every sample once (tp ranks each count every sample: the same mean).
    # A live group adds every group's share in the order DDP's sum over ranks does.
    totals = torch.zeros(4, device=h.device, dtype=torch.float64)
    for share in h.validation_shares():
        totals += _share_totals(t, module, t._loader(val_data, evaluation=True, share=share))
    module.train(was_training)
    if h.world_size > 1:
        torch.distributed.all_reduce(totals)
    classify = totals[3].item() == 0
    count = totals[2].clamp(min=1)
    result = {"val_loss": (totals[0] / count).item()}
    if classify:
        result["val_accuracy"] = (totals[1] / count).item()
    return result


def _share_totals(t: Trainer, module: nn.Module, loader: DataLoader) -> torch.Tensor:
    """One data rank's validation sums (see ``validate``)."""
    h = t.harness
    totals = torch.zeros(4, device=h.device, dtype=torch.float64)
    batches = lockstep_batches(loader, h.device) if h.sharded else ((b, True) for b in loader)
    for batch, counts in batches:
        heartbeat(t.global_step)  # a long validation is progress too
        batch = h.to_device(batch)
        loss, correct = _evaluate(t, module, batch)
        if not counts or loss is None:
            continue
        n = samples_in(batch)
        totals[0] += loss.double() * n
        totals[2] += n
        if correct is None:
            totals[3] += 1
        else:
            totals[1] += correct
    return totals


def _evaluate(t: Trainer, module: nn.Module, batch: Any
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A validation batch's mean loss (None on a pipeline stage without outputs) and,
    for class targets, its number of correct predictions."""
    h = t.harness
    if t.pipeline or (is_pair(batch) and t.step_fn is None):
        inputs, targets = pipeline_pair(batch)
        with h.autocast():
            outputs = t.model.evaluate(inputs, targets) if t.pipeline \
                else module(inputs)
    else:
        with h.autocast():
            return loss_of(module, batch, t.loss_fn, t.step_fn), None
    if outputs is None:
        return None, None
    if not isinstance(outputs, torch.Tensor):  # the model's own structure
        return (t.loss_fn(outputs, targets) if t.loss_fn else model_loss(outputs)), None
    loss = (t.loss_fn or F.cross_entropy)(outputs.float(), targets)
    if outputs.dim() == 2 and not targets.is_floating_point():
        return loss, (outputs.argmax(dim=1) == targets).sum()
    return loss, None

