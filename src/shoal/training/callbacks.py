"""`shoal.Callback`: your code at the loop's points, and the runner that calls it.

    class PrintLR(shoal.Callback):
        def on_step_end(self, trainer, metrics):
            if metrics["step"] % 100 == 0 and shoal.is_main():
                print(metrics["step"], metrics["lr"])

    Trainer(model, optimizer, callbacks=[PrintLR(), EarlyStopping("val_loss", patience=3)])

Every rank calls every hook, at the same step (each hook is a no-op by default). The loop's
order: ``on_fit_start`` (after a resume: after ``on_resume``), then a pass per epoch:
``on_epoch_start``, ``on_step_end`` after each optimizer step, ``on_save_checkpoint`` and
``on_checkpoint_saved`` around each save, ``on_validation_end`` after each validation
(``val_every_steps``, and the epoch's end), ``on_epoch_end``; then ``on_fit_end``; or
``on_exception`` where the loop raised. A callback with ``state_dict`` and
``load_state_dict`` (JSON-able values) is saved in each checkpoint and resumed with the run.

A hook may ask the run to stop (``trainer.stop(reason)``): every rank stops after the same
step (the ranks agree at each step's end where a callback is given: one all-reduce of a
flag), validates and saves as at the run's end; a resumed run that had stopped has finished.
In live mode a stop decided from the job's figures (validation's, the same in every replica
group) stops every group after the same step; one decided from a group's own (its ranks'
step loss) stops that group's ranks only, and the others go on without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from shoal.imports import build_named

Trainer = Any  # a shoal.Trainer (not imported: its module imports this one)

HOOKS = ("on_fit_start", "on_fit_end", "on_epoch_start", "on_epoch_end", "on_step_end",
         "on_validation_end", "on_save_checkpoint", "on_checkpoint_saved", "on_resume",
         "on_exception")


class Callback:
    """Hooks at the loop's natural points; override the ones you need (each is a no-op).
    See the module's docstring for their order, and docs/training.md.

    Never raises. What a hook raises ends the run as an error of the loop would (after
    ``on_exception``)."""

    stops: ClassVar[bool] = True
    """It may ask the run to stop (``trainer.stop``). A callback that never does may say
    False: where none may, the ranks do not agree on a stop at each step's end (one
    all-reduce of a flag a step)."""
    stops_alike: ClassVar[bool] = False
    """It asks to stop only from figures every rank shares (a validation's), so every rank
    asks at the same step and none need agree (``EarlyStopping``)."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step (after a resume: from its step)."""

    def on_fit_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After the last step and its validation: ``fit``'s result."""

    def on_epoch_start(self, trainer: Trainer) -> None:
        """Before an epoch's first step (``trainer.epoch``); not again where a resume or a
        live step done again goes on inside it."""

    def on_epoch_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After an epoch and its validation: the epoch's metrics (``train_loss``,
        ``val_loss``, ...)."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After each optimizer step: ``step``, ``epoch``, ``loss`` (this rank's last
        micro-batch's) and ``lr`` (the first parameter group's, as the next step uses)."""

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After each validation: ``step`` and its figures (``val_loss``, ...), the same on
        every rank."""

    def on_save_checkpoint(self, trainer: Trainer, step: int) -> None:
        """Before the checkpoint of ``step`` is written (every rank of the group that saves
        it: a save is collective; in live mode every group saves the last step)."""

    def on_checkpoint_saved(self, trainer: Trainer, step: int, path: str) -> None:
        """After the checkpoint of ``step`` is in ``path`` (an asynchronous save: handed
        over; committed before ``fit`` returns)."""

    def on_resume(self, trainer: Trainer, step: int) -> None:
        """After the run's state (and this callback's) is back from a checkpoint."""

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        """The loop raised ``error`` (it is raised on after the callbacks)."""


def build_callbacks(specs: Iterable[Any]) -> list[Callback]:
    """Callbacks from objects, import paths ('module:Class') and ``{builder, args}``
    mappings (a run config's ``trainer.callbacks``, imported as builders are)."""
    return [build_named(dict(spec) if isinstance(spec, Mapping) else spec,
                        f"trainer.callbacks[{i}]", Callback) for i, spec in enumerate(specs)]


class Callbacks:
    """A Trainer's callbacks: calls a hook on each, keeps their states, and agrees a stop
    over the ranks."""

    def __init__(self, callbacks: Sequence[Callback]):
        self.callbacks = list(callbacks)
        # the hooks some callback overrides, read once (the loop asks each step)
        self._overridden = frozenset(hook for hook in HOOKS for c in self.callbacks
                                     if getattr(type(c), hook) is not getattr(Callback, hook))
        # (ranks agree on a stop each step where one may ask from what it alone sees)
        self._stoppers = any(c.stops and not c.stops_alike for c in self.callbacks)
        self.stop_reason: str | None = None
        """Why the run stops (``Trainer.stop``), once every rank agreed; or why it had."""
        self._asked: str | None = None  # this rank's request, not yet agreed

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def wants(self, hook: str) -> bool:
        """Some callback overrides ``hook`` (the loop computes its arguments only then)."""
        return hook in self._overridden

    def fire(self, hook: str, trainer: Any, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(trainer, *args)

    def ask_stop(self, reason: str) -> None:
        self._asked = self._asked or reason

    def stop_agreed(self, device: torch.device) -> bool:
        """Whether any rank asked to stop (collective where a callback may stop: every rank
        of the process group calls it at the same point)."""
        if self.stop_reason is not None:
            return True
        asked = self._asked is not None
        if not self._stoppers:  # (asked alike on every rank, or never)
            if asked:
                self.stop_reason = self._asked
            return asked
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            flag = torch.tensor([float(asked)], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            asked = bool(flag.item())
        if asked:
            self.stop_reason = self._asked or "another rank's callback asked to stop"
        return asked

    def state_dict(self) -> dict[str, Any]:
        """Each stateful callback's state, by its place and class; and a stop agreed."""
        states = {f"{i}:{type(c).__qualname__}": c.state_dict()
                  for i, c in enumerate(self.callbacks) if hasattr(c, "state_dict")}
        return {"states": states, "stop_reason": self.stop_reason}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """What ``state_dict`` gave; a callback the checkpoint has no state of starts anew
        (one added since), one it has that is gone is dropped."""
        states = state.get("states", {})
        for i, callback in enumerate(self.callbacks):
            key = f"{i}:{type(callback).__qualname__}"
            if key in states and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(states[key])
        self.stop_reason = state.get("stop_reason")
