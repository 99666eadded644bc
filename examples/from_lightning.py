"""A Lightning script, ported to shoal: early stopping, the best checkpoints, the learning
rate logged, and a callback of one's own (docs/training.md, "Coming from Lightning", shows
the Lightning script side by side).

    shoal run --nproc-per-node 2 examples/from_lightning.py OUT

Lightning's LightningModule becomes the model and the optimizer, ``Trainer.fit`` stays;
``ModelCheckpoint(monitor, mode, save_top_k)`` is ``shoal.BestCheckpoints``,
``EarlyStopping`` is ``shoal.EarlyStopping``, ``LearningRateMonitor`` is the step metrics'
``lr`` (and ``train/lr`` in every tracker), ``val_check_interval`` is ``val_every_steps``.
Writes OUT/result.json: the final metrics, the best checkpoints, the learning rates seen.
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

import shoal
from shoal.examples.digits import build_data


class LearningRates(shoal.Callback):
    """A callback of one's own: the learning rate of every 10th step (Lightning's
    ``on_train_batch_end``), and a line after each validation."""

    def __init__(self):
        self.rates: dict[int, float] = {}

    def on_step_end(self, trainer, metrics):
        if metrics["step"] % 10 == 0:
            self.rates[metrics["step"]] = metrics["lr"]

    def on_validation_end(self, trainer, metrics):
        if shoal.is_main():
            print(f"step {metrics['step']}: val_loss {metrics['val_loss']:.4f}", flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    shoal.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    best = shoal.BestCheckpoints(monitor="val_loss", mode="min", save_top_k=2)
    rates = LearningRates()
    trainer = shoal.Trainer(
        model, optimizer, lr_scheduler=scheduler, batch_size=32, epochs=20, seed=0,
        progress=False, val_every_steps=20, checkpoint_dir=str(out / "checkpoints"),
        checkpoint_every=20, resume="auto", metrics={"dir": str(out / "metrics")},
        callbacks=[shoal.EarlyStopping(monitor="val_loss", patience=3, min_delta=0.005),
                   best, rates])
    train, val = build_data(val_fraction=0.2, seed=0)
    result = trainer.fit(train, val)
    if shoal.is_main():
        (out / "result.json").write_text(json.dumps(
            {"result": result, "best": best.best, "rates": rates.rates,
             "stopped": trainer.callbacks.stop_reason}))
    shoal.cleanup()


if __name__ == "__main__":
    main()
