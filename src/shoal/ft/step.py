"""What a live session and its trainer say to each other: the outcome of each step, the
state a session reads and loads (``GroupState``), and the numbers that travel with a step.
"""

from __future__ import annotations

import copy
import enum
import math
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class LiveError(RuntimeError):
    """A live step cannot go on (no lighthouse, no quorum in time): said in one line."""


class StepOutcome(enum.Enum):
    """What became of a step, as the session says it."""

    GO = "go"
    """The step goes ahead (``begin_step``, ``join``)."""
    COMMITTED = "committed"
    """The step is applied: every group that took part applies the same mean."""
    AGAIN = "again"
    """The step did not commit and nothing of it was applied: it is done again from where it
    began."""
    HEALED = "healed"
    """This group loaded a live group's state (``GroupState.load_state_dict``): training
    goes on from that state's step and data position."""


class GroupState(Protocol):
    """What a step changes, as a live session reads and loads it (a Trainer's
    ``shoal.training.state.TrainState``)."""

    global_step: int

    @property
    def periodic(self) -> bool: ...

    def state_dict(self, *, heal: bool = False) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, heal: bool = False) -> None: ...

    def private_state(self) -> dict[str, Any]: ...

    def load_private_state(self, state: dict[str, Any]) -> None: ...

    def blank_gradients(self) -> list[torch.Tensor]: ...


def state_bytes(state: object) -> int:
    """Bytes of the tensors in a (nested) state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


class Kept(tuple):
    """Items that are never changed in place once made (a group's figures of its past
    steps): ``copied`` keeps them as they are."""

    __slots__ = ()


def copied(state: Any) -> Any:
    """A deep copy of a (nested) state: its tensors cloned, its dicts, lists and tuples
    made anew (``Kept`` ones kept), anything else deep-copied (about 5 times as fast as
    ``copy.deepcopy``, whose copy of a tensor is a slow path: a hand-over copies the
    group's state)."""
    if isinstance(state, Kept):
        return state
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if type(state) in (dict, OrderedDict):  # (a module's state_dict is an OrderedDict)
        return type(state)((k, copied(v)) for k, v in state.items())
    if type(state) is list:
        return [copied(v) for v in state]
    if type(state) is tuple:
        return tuple(copied(v) for v in state)
    if state is None or isinstance(state, (bool, int, float, str, bytes)):
        return state
    return copy.deepcopy(state)


SPLIT = 2**20  # a length in two parts: float32 holds each exactly (up to 2**44 bytes)


def loss_parts(value: float) -> tuple[float, float, float]:
    """``value`` (float64) as three float32 numbers whose sum in float64 is ``value``
    (exact for losses of 1e-20 and up)."""
    high = _float32(value)
    middle = _float32(value - high)
    return high, middle, _float32(value - high - middle)


_FLOAT32 = struct.Struct("f")


def _float32(value: float) -> float:
    """``value`` rounded to float32, as a cast rounds it (a third of numpy's time: this
    runs every live step)."""
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:  # beyond float32's range: the cast's infinity
        return math.copysign(math.inf, value)


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` into ``tensors``, one after the other."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
