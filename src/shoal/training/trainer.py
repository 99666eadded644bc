"""`shoal.Trainer`: a data-parallel training loop with accumulation, precision and validation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from shoal.data.sharding import agreed_batches, agreed_length, set_epoch
from shoal.errors import UsageError
from shoal.training.config import TrainerConfig
from shoal.training.harness import Harness, seed_everything
from shoal.training.progress import Progress

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _unpack(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise UsageError("the Trainer expects batches of (inputs, targets); "
                     f"got {type(batch).__name__}")


def _batch_len(batch: Any) -> int:
    inputs = batch[0]
    return inputs.shape[0] if isinstance(inputs, torch.Tensor) else len(inputs)


class Trainer:
    """Train ``model`` with ``optimizer`` on every process of the job.

    Settings are the fields of ``TrainerConfig`` (strategy, precision, batch_size,
    accumulate_grad_batches, clip_grad_norm, epochs, max_steps, seed, ...).
    ``loss_fn(outputs, targets)`` must average over the batch; it defaults to cross-entropy.
    ``lr_scheduler`` is a scheduler, or a function of the optimizer returning one; it is
    stepped after every optimizer step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 loss_fn: LossFn | None = None, lr_scheduler: Any = None, **settings: Any):
        self.config = TrainerConfig.build(**settings)
        c = self.config
        self.harness = Harness(c.strategy, c.precision, backend=c.backend, ddp=c.ddp,
                               seed=c.seed)
        # Each rank gets its own stream of random numbers (dropout); the data order comes
        # from the sampler's seed and is the same on every rank.
        seed_everything(c.seed + self.harness.rank)
        self.model, self.optimizer = self.harness.setup(model, optimizer)
        self.loss_fn = loss_fn or F.cross_entropy
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(optimizer)
        self.lr_scheduler = lr_scheduler
        self.global_step = 0
        self.epoch = 0
        self.history: list[dict[str, float]] = []

    @property
    def module(self) -> nn.Module:
        """The user's model, without the strategy's wrapper."""
        return getattr(self.model, "module", self.model)

    def _loader(self, data: Dataset | DataLoader, evaluation: bool) -> DataLoader:
        return self.harness.setup_dataloader(data, self.config.batch_size, shuffle=True,
                                             evaluation=evaluation,
                                             num_workers=self.config.num_workers)

    def fit(self, train_data: Dataset | DataLoader, val_data: Dataset | DataLoader | None = None,
            epochs: int | None = None, max_steps: int | None = None) -> dict[str, float]:
        """Train; validate after each epoch when ``val_data`` is given. Returns final metrics."""
        c = self.config
        epochs = epochs or c.epochs
        max_steps = max_steps or c.max_steps
        if epochs is None and max_steps is None:
            epochs = 1
        loader = self._loader(train_data, evaluation=False)
        progress = Progress(self._total_steps(loader, epochs, max_steps),
                            enabled=c.progress and self.harness.is_main)
        metrics: dict[str, float] = {}
        try:
            while epochs is None or self.epoch < epochs:
                metrics = {"epoch": self.epoch, **self._train_epoch(loader, progress, max_steps)}
                if val_data is not None:
                    metrics.update(self.validate(val_data))
                self.history.append(metrics)
                self.epoch += 1
                self._report_epoch(metrics, progress)
                if max_steps is not None and self.global_step >= max_steps:
                    break
        finally:
            progress.close()
        return {**metrics, "global_step": self.global_step}

    def _total_steps(self, loader: DataLoader, epochs: int | None, max_steps: int | None
                     ) -> int | None:
        try:
            per_epoch = math.ceil(len(loader) / self.config.accumulate_grad_batches)
        except TypeError:
            return max_steps
        total = per_epoch * epochs if epochs is not None else None
        return min(x for x in (total, max_steps) if x is not None) if total or max_steps else None

    def _train_epoch(self, loader: DataLoader, progress: Progress, max_steps: int | None
                     ) -> dict[str, float]:
        h, c, model = self.harness, self.config, self.model
        k = c.accumulate_grad_batches
        model.train()
        set_epoch(loader, self.epoch)
        length = agreed_length(loader, h.device)
        loss_sum = torch.zeros((), device=h.device, dtype=torch.float64)
        micro_batches = samples = 0
        start = time.perf_counter()
        pending = False  # gradients accumulated since the last optimizer step
        for i, batch in enumerate(agreed_batches(loader, length, h.device)):
            position = i % k
            window = k if length is None else min(k, length - (i - position))
            step_now = position == window - 1
            # All-reduce only on the micro-batch that ends the window. An unsized loader's
            # last batch is not known in advance, so there every micro-batch syncs.
            sync = step_now or length is None
            inputs, targets = _unpack(h.to_device(batch))
            with h.no_sync(model, enabled=not sync):
                with h.autocast():
                    loss = self.loss_fn(model(inputs), targets)
                h.backward(loss / window if window > 1 else loss)
            loss_sum += loss.detach()
            micro_batches += 1
            samples += _batch_len(batch)
            pending = not step_now
            if step_now:
                self._optimizer_step()
                if progress.wants_update():
                    rate = samples * h.world_size / (time.perf_counter() - start)
                    progress.update(self.global_step, self.epoch, loss.item(), rate)
                if max_steps is not None and self.global_step >= max_steps:
                    break
        if pending:  # an unsized loader ended inside a window; its gradients are synced
            self._optimizer_step()
        if micro_batches == 0:
            raise UsageError("the training data gave no batch this epoch (on every rank): "
                             "is the dataset smaller than world size x batch size?")
        totals = torch.stack([loss_sum, torch.tensor(float(micro_batches), device=h.device,
                                                     dtype=torch.float64)])
        if h.world_size > 1:
            torch.distributed.all_reduce(totals)
        return {"train_loss": (totals[0] / totals[1].clamp(min=1)).item()}

    def _optimizer_step(self) -> None:
        self.harness.step(self.optimizer, model=self.model,
                          clip_grad_norm=self.config.clip_grad_norm)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_step += 1

    @torch.no_grad()
    def validate(self, val_data: Dataset | DataLoader) -> dict[str, float]:
        """Loss (and accuracy for class targets) over the whole validation set, all ranks."""
        h = self.harness
        loader = self._loader(val_data, evaluation=True)
        module = self.module
        was_training = module.training
        module.eval()
        # loss * n, correct, n: summed over ranks, so the mean weights every sample once.
        totals = torch.zeros(3, device=h.device, dtype=torch.float64)
        classify = True
        for batch in loader:
            inputs, targets = _unpack(h.to_device(batch))
            with h.autocast():
                outputs = module(inputs)
            n = targets.shape[0]
            totals[0] += self.loss_fn(outputs.float(), targets).double() * n
            totals[2] += n
            classify = classify and outputs.dim() == 2 and not targets.is_floating_point()
            if classify:
                totals[1] += (outputs.argmax(dim=1) == targets).sum()
        module.train(was_training)
        if h.world_size > 1:
            torch.distributed.all_reduce(totals)
        count = totals[2].clamp(min=1)
        result = {"val_loss": (totals[0] / count).item()}
        if classify:
            result["val_accuracy"] = (totals[1] / count).item()
        return result

    def _report_epoch(self, metrics: dict[str, float], progress: Progress) -> None:
        if not progress.enabled:
            return
        parts = [f"epoch {metrics['epoch']}", f"train_loss {metrics['train_loss']:.4f}"]
        if "val_loss" in metrics:
            parts.append(f"val_loss {metrics['val_loss']:.4f}")
        if "val_accuracy" in metrics:
            parts.append(f"val_accuracy {metrics['val_accuracy']:.2%}")
        print(" · ".join(parts), flush=True)
