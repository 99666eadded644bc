"""`shoal.EarlyStopping`: stop when a validation figure stops improving.

    Trainer(..., val_every_steps=200, callbacks=[EarlyStopping("val_loss", patience=3)])

After each validation, ``monitor`` improves where it beats the best so far by more than
``min_delta`` (lower under ``mode='min'``, higher under 'max'); after ``patience``
validations without an improvement the run stops (every rank, and in live mode every
replica group: validation's figures are the job's). Its best and its count are saved in
checkpoints: a resumed run stops where the run without the stop would have.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from shoal.errors import UsageError
from shoal.training.callbacks import Callback

if TYPE_CHECKING:
    from shoal.training.trainer import Trainer


class EarlyStopping(Callback):
    """Stop the run after ``patience`` validations in which ``monitor`` did not improve on
    its best by more than ``min_delta`` (lower under ``mode='min'``, higher under 'max').

    Raises:
        UsageError: If ``mode`` is neither, ``patience`` is under 1 or ``min_delta`` under
            0; at a validation, if its figures have no ``monitor``.
    """

    stops_alike = True  # (from validation's figures, the same on every rank)

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0,
                 mode: Literal["min", "max"] = "min"):
        if mode not in ("min", "max"):
            raise UsageError(f"EarlyStopping: mode must be 'min' or 'max', not {mode!r}")
        if patience < 1 or min_delta < 0:
            raise UsageError("EarlyStopping: patience must be at least 1 and min_delta "
                             f"at least 0 (got {patience}, {min_delta})")
        self.monitor, self.patience, self.min_delta, self.mode = (monitor, patience,
                                                                  min_delta, mode)
        self.best = math.inf if mode == "min" else -math.inf
        self.waited = 0
        """Validations since the last improvement."""
        self.best_step: int | None = None

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            raise UsageError(f"EarlyStopping: validation gives no {self.monitor!r} (it gives "
                             f"{', '.join(k for k in metrics if k != 'step')})")
        value = metrics[self.monitor]
        better = (value < self.best - self.min_delta if self.mode == "min"
                  else value > self.best + self.min_delta)
        if better:
            self.best, self.waited, self.best_step = value, 0, int(metrics["step"])
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.stop(f"early stopping: {self.monitor} did not improve on {self.best:.6g} "
                         f"(step {self.best_step}) by more than {self.min_delta:g} in "
                         f"{self.patience} validations")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "waited": self.waited, "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.waited = state["best"], state["waited"]
        self.best_step = state["best_step"]
