"""What each live group keeps of its steps, so that the group that writes the step metrics
after another loses none of them.

In a live job the first group of the quorum writes the step metrics (group 0 where it
takes part) and keeps each window of steps in memory until its last step. A SIGKILL takes
that window with it, and under policy 'available' the other groups go on without it for a
while (and the next group writes). So every group keeps its own figures of the steps (its
losses and samples are the job's, the same as the writer's, see
``shoal.training.live.step_figures``) until a window ends with every group in its last
step, and sends them with its state when it heals a group (``TrainState.unwritten``). A
group that becomes the writer writes those after the last step its file holds
(``StepMetrics.adopt``), with the wall time the group that kept them measured and no
split of it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

WINDOWS = 20
"""At most this many windows of steps are kept (a group missing for long under
'available'): a window that every group saw end is dropped at once."""


class StepFigures(NamedTuple):
    """A step's figures of this rank, as ``StepMetrics.step`` takes them, and its wall
    time (kept as a plain tuple)."""

    step: int
    epoch: int
    lr: float
    loss: torch.Tensor
    grad_norm: torch.Tensor | None
    samples: int
    tokens: int
    bytes: float
    seconds: float


class Counters(Protocol):
    """Where the steps are kept, and the step and epoch just taken (a Trainer's
    ``TrainState``)."""

    global_step: int
    epoch: int
    unwritten: list[tuple]


class UnwrittenSteps:
    """Keeps a live group's figures of each step in ``state.unwritten`` until the window
    they are in has been written."""

    def __init__(self, state: Counters, every: int):
        self.state, self.every = state, every
        self._at = time.perf_counter()

    def begin(self) -> None:
        """Start of an epoch: the next step's wall time counts from here."""
        self._at = time.perf_counter()

    def step(self, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor | None,
             samples: int, tokens: int, sent: float, everyone: bool) -> None:
        """The step just taken (``state.global_step``); ``everyone``: every group took part
        in it (so the writing group did, and wrote its window if it ends here)."""
        now = time.perf_counter()
        s = self.state
        s.unwritten.append((s.global_step, s.epoch, lr, loss, grad_norm, samples, tokens,
                            sent, now - self._at))
        self._at = now
        if s.global_step % self.every == 0 and everyone:
            s.unwritten.clear()
        elif len(s.unwritten) > WINDOWS * self.every:
            del s.unwritten[:self.every]
