"""`shoal.BestCheckpoints`: keep the checkpoints of the best validations beside the last ones.

    Trainer(..., checkpoint_dir="ck", val_every_steps=500,
            callbacks=[BestCheckpoints("val_loss", mode="min", save_top_k=2)])

After each validation whose ``monitor`` ranks among the ``save_top_k`` best so far, the
step's checkpoint is written (``Trainer.save_checkpoint``; unless it has one), and the
store keeps it beside the newest ``keep_last`` until a better one pushes it out.
``CHECKPOINT_DIR/best.json`` names them, best first, once the step's checkpoint is saved.
A resume still takes the newest checkpoint; the best list is saved in checkpoints, so a
resumed run keeps the same ones as the run without the stop.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any, Literal

from shoal.errors import UsageError
from shoal.training.callbacks import Callback

if TYPE_CHECKING:
    from shoal.training.trainer import Trainer

BEST = "best.json"


class BestCheckpoints(Callback):
    """Keep the checkpoints of the ``save_top_k`` validations with the lowest (``mode='min'``)
    or highest ('max') ``monitor``; ``best`` lists them as (value, step), best first (on an
    equal value the earlier step ranks first).

    Raises:
        UsageError: If ``mode`` is neither or ``save_top_k`` is under 1; at the start of
            ``fit``, if the Trainer has no ``checkpoint_dir``; at a validation, if its
            figures have no ``monitor``.
    """

    stops = False

    def __init__(self, monitor: str = "val_loss", mode: Literal["min", "max"] = "min",
                 save_top_k: int = 1):
        if mode not in ("min", "max"):
            raise UsageError(f"BestCheckpoints: mode must be 'min' or 'max', not {mode!r}")
        if save_top_k < 1:
            raise UsageError(f"BestCheckpoints: save_top_k must be at least 1, not {save_top_k}")
        self.monitor, self.mode, self.save_top_k = monitor, mode, save_top_k
        self.best: list[tuple[float, int]] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        if trainer.checkpointing is None:
            raise UsageError("BestCheckpoints needs a checkpoint_dir")
        self._keep(trainer)

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            raise UsageError(f"BestCheckpoints: validation gives no {self.monitor!r} (it "
                             f"gives {', '.join(k for k in metrics if k != 'step')})")
        value, step = float(metrics[self.monitor]), int(metrics["step"])
        if not math.isfinite(value):
            return
        sign = 1 if self.mode == "min" else -1
        ranked = sorted({s: (v, s) for v, s in [*self.best, (value, step)]}.values(),
                        key=lambda entry: (sign * entry[0], entry[1]))[:self.save_top_k]
        if (value, step) not in ranked:
            return
        self.best = ranked
        self._keep(trainer)
        trainer.save_checkpoint()

    def on_checkpoint_saved(self, trainer: Trainer, step: int, path: str) -> None:
        if any(step == best for _, best in self.best):
            self._write(trainer)

    @property
    def best_step(self) -> int | None:
        """The step of the best validation so far (its checkpoint: ``step_<N>``)."""
        return self.best[0][1] if self.best else None

    def _keep(self, trainer: Trainer) -> None:
        assert trainer.checkpointing is not None  # on_fit_start says so
        trainer.checkpointing.store.kept = {step for _, step in self.best}

    def _write(self, trainer: Trainer) -> None:
        """best.json, from the rank that writes the run's files (whole or absent)."""
        assert trainer.checkpointing is not None
        if trainer.harness.rank != 0 or not trainer._saves:
            return
        store = trainer.checkpointing.store
        listed = [{"step": step, self.monitor: value, "path": store.path_for(step).name}
                  for value, step in self.best]
        path = store.root / BEST
        partial = path.with_name(f"{BEST}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"monitor": self.monitor, "mode": self.mode,
                                       "best": listed}, indent=1) + "\n")
        partial.replace(path)

    def state_dict(self) -> dict[str, Any]:
        return {"best": [list(entry) for entry in self.best]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = [(float(v), int(s)) for v, s in state["best"]]
