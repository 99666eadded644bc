"""A job for the callback tests, run under `shoal run` (never collected by pytest).

    python -m shoal run --nproc-per-node W [--max-restarts 1] \\
        tests/training/callbacks_job.py OUT [--kill RANK:STEP] [--observers] [--strategy S]

The digits MLP with dropout, a validation every 4 steps and a checkpoint every 3 (resumed
'auto'), stopped early on val_loss (patience 2, min_delta 0.02). ``--kill``: in the first
attempt that rank SIGKILLs itself after that step. ``--observers``: also a callback on every
hook, that logs what it saw, and the 2 best checkpoints by val_loss kept. Rank r writes
OUT/final.r<r>.pt: its weights, the step it stopped at, the early stopping's state, the
hooks seen (this attempt's), the best checkpoints."""

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import shoal
from shoal.examples.digits import build_data
from shoal.training.callbacks import HOOKS


class Killer(shoal.Callback):
    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_step_end(self, trainer, metrics):
        if shoal.rank() == self.rank and metrics["step"] == self.step and \
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


class Seen(shoal.Callback):
    """Every hook's name, as it is called (a state of its own, resumed with the run)."""

    def __init__(self):
        self.seen: list[str] = []
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


for _hook in HOOKS:
    def _log(self, trainer, *args, _name=_hook):
        self.seen.append(_name)
        if _name == "on_step_end":
            self.steps += 1
    setattr(Seen, _hook, _log)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill", default=None)
    parser.add_argument("--observers", action="store_true")
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    out = Path(args.out)
    shoal.init("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))
    stopping = shoal.EarlyStopping("val_loss", patience=2, min_delta=0.02)
    callbacks: list[shoal.Callback] = [stopping]
    seen = Seen()
    best = shoal.BestCheckpoints("val_loss", save_top_k=2)
    if args.observers:
        callbacks += [seen, best]
    if args.kill:
        rank, step = map(int, args.kill.split(":"))
        callbacks.append(Killer(rank, step))
    trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                            batch_size=32, epochs=8, seed=0, progress=False,
                            val_every_steps=4, checkpoint_dir=str(out / "checkpoints"),
                            checkpoint_every=3, resume="auto", callbacks=callbacks,
                            strategy=args.strategy)
    train, val = build_data(val_fraction=0.2, seed=0)
    result = trainer.fit(train, val)
    weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    torch.save({"model": weights, "step": trainer.global_step,
                "result": result, "stopping": stopping.state_dict(), "seen": seen.seen,
                "steps_seen": seen.steps, "reason": trainer.callbacks.stop_reason,
                "best": best.best},
               out / f"final.r{shoal.rank()}.pt")


if __name__ == "__main__":
    main()
