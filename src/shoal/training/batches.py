"""Batches of any structure: moved to the device whole, counted, and turned into a loss.

A batch is what the DataLoader yields: an ``(inputs, targets)`` pair, a mapping (a dict, a
transformers ``BatchEncoding``), a dataclass, a tuple or list of another length, or a lone
tensor, nested as deep as it likes. How the model is called on it and where the loss comes
from (``loss_of``):

=====================  ======================  ==============================================
batch                  model called as          loss
=====================  ======================  ==============================================
(inputs, targets)      ``model(inputs)``        ``loss_fn(outputs, targets)`` (cross-entropy)
mapping                ``model(**batch)``       ``loss_fn(outputs, batch)``, else the model's
dataclass              ``model(**fields)``      ``outputs.loss`` / ``outputs["loss"]``
other tuple or list    ``model(*batch)``
tensor                 ``model(batch)``
=====================  ======================  ==============================================

``step_fn(model, batch) -> loss`` replaces all of it: the user calls the model as they wish.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.errors import UsageError

LossFn = Callable[[Any, Any], torch.Tensor]
StepFn = Callable[[nn.Module, Any], torch.Tensor]


def is_pair(batch: Any) -> bool:
    """An ``(inputs, targets)`` batch (a tuple or list of two; a namedtuple is a tuple)."""
    return isinstance(batch, (list, tuple)) and len(batch) == 2


def _fields(batch: Any) -> dict[str, Any]:
    """A dataclass instance's fields, shallow (``asdict`` would copy every tensor)."""
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def _is_dataclass(batch: Any) -> bool:
    return dataclasses.is_dataclass(batch) and not isinstance(batch, type)


def move_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device``, structure and types kept (tuples,
    namedtuples, lists, mappings, dataclasses, nested). A copy from the host to an
    accelerator does not wait (it overlaps compute when the host memory is pinned)."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=batch.device.type == "cpu")
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(move_to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        moved = {k: move_to_device(v, device) for k, v in batch.items()}
        try:
            return cast(Any, type(batch))(moved)  # a dict subclass, a BatchEncoding: the same type
        except TypeError:
            return moved
    if _is_dataclass(batch):
        return dataclasses.replace(batch, **{k: move_to_device(v, device)
                                              for k, v in _fields(batch).items()})
    return batch


def leaves(batch: Any) -> list[Any]:
    """The tensors and other leaves of a batch, in order."""
    if isinstance(batch, (list, tuple)):
        return [leaf for b in batch for leaf in leaves(b)]
    if isinstance(batch, Mapping):
        return [leaf for b in batch.values() for leaf in leaves(b)]
    if _is_dataclass(batch):
        return [leaf for b in _fields(batch).values() for leaf in leaves(b)]
    return [batch]


def samples_in(batch: Any) -> int:
    """The batch's sample count: the first dimension of its first tensor (of an
    ``(inputs, targets)`` pair: of the inputs), else the length of its first leaf."""
    first = batch[0] if is_pair(batch) else batch
    found = leaves(first)
    for leaf in found:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    if found and hasattr(found[0], "__len__"):
        return len(found[0])
    raise UsageError(f"cannot tell how many samples a batch of {type(batch).__name__} holds: "
                     "it has no tensor with a batch dimension")


def _token_ids(tensor: Any) -> int:
    if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and not (
            tensor.is_floating_point() or tensor.is_complex()):
        return tensor.numel()
    return 0


def tokens_in(batch: Any) -> int:
    """Tokens in a batch of token ids, for tokens/s: an integer tensor with a sequence
    dimension (the inputs of a pair, ``input_ids`` of a mapping or dataclass); 0 if none."""
    if is_pair(batch):
        return _token_ids(batch[0])
    if isinstance(batch, torch.Tensor):
        return _token_ids(batch)
    fields = batch if isinstance(batch, Mapping) else \
        _fields(batch) if _is_dataclass(batch) else {}
    return _token_ids(fields.get("input_ids"))


def model_loss(outputs: Any) -> torch.Tensor:
    """The loss a model returned itself: ``outputs["loss"]`` or ``outputs.loss``."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else \
        getattr(outputs, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"the model returned {type(outputs).__name__} without a 'loss' (a "
                         "transformers model returns one when the batch has 'labels'): pass "
                         "labels in the batch, or loss_fn(outputs, batch), or "
                         "step_fn(model, batch)")
    return loss


def forward(model: nn.Module, batch: Any) -> tuple[Any, Any]:
    """``(outputs, what loss_fn compares them with)``: the model called as the batch's
    structure says (see the module docstring)."""
    if is_pair(batch):
        return model(batch[0]), batch[1]
    if isinstance(batch, Mapping):
        return model(**batch), batch
    if _is_dataclass(batch):
        return model(**_fields(batch)), batch
    if isinstance(batch, (list, tuple)):
        return model(*batch), batch
    return model(batch), batch


def loss_of(model: nn.Module, batch: Any, loss_fn: LossFn | None,
            step_fn: StepFn | None) -> torch.Tensor:
    """The batch's mean loss: ``step_fn``'s, else the model called as the batch's structure
    says and ``loss_fn``, cross-entropy (pairs) or the model's own loss."""
    if step_fn is not None:
        return step_fn(model, batch)
    outputs, target = forward(model, batch)
    if loss_fn is not None:
        return loss_fn(outputs, target)
    if is_pair(batch) and isinstance(outputs, torch.Tensor):
        return F.cross_entropy(outputs, target)
    return model_loss(outputs)


def check_loss_functions(loss_fn: Any, step_fn: Any) -> None:
    """At most one of them, and callable with the documented two arguments."""
    if loss_fn is not None and step_fn is not None:
        raise UsageError("pass loss_fn(outputs, batch) or step_fn(model, batch), not both: "
                         "step_fn computes the loss itself")
    for name, fn, signature in (("loss_fn", loss_fn, "(outputs, batch)"),
                                ("step_fn", step_fn, "(model, batch)")):
        if fn is None:
            continue
        if not callable(fn):
            raise UsageError(f"{name} must be a function {signature} -> loss; got "
                             f"{type(fn).__name__}")
        try:
            inspect.signature(fn).bind(None, None)
        except TypeError:
            raise UsageError(f"{name} must take two arguments {signature} and return the "
                             f"batch's mean loss; {getattr(fn, '__name__', fn)!r} takes "
                             f"{inspect.signature(fn)}") from None
        except ValueError:
            pass  # a builtin without a signature: called as documented


def pipeline_pair(batch: Any) -> tuple[Any, Any]:
    """A pipeline's batch: its stages pass one tensor along and the last compares it with
    the targets, so batches must be (inputs, targets)."""
    if is_pair(batch):
        return batch[0], batch[1]
    raise UsageError("with pipeline parallelism batches must be (inputs, targets) pairs; got "
                     f"{type(batch).__name__}")
