"""A training job for the resume tests, run under `shoal run` (never collected by pytest).

    python -m shoal run --nproc-per-node W [--max-restarts K] tests/checkpoint/job.py OUT \\
        [--kills JSON] [--steps N] [--every E] [--accumulate K] [--no-checkpoints] \\
        [--trainer JSON]

Trains a small MLP on a dataset whose inputs carry each sample's index, so every rank can
log which global samples each optimizer step consumed. ``--kills`` is a JSON list, one entry
per attempt (TORCHELASTIC_RESTART_COUNT), of [rank, step, where]: that rank kills itself
with SIGKILL after that optimizer step ("step") or inside the checkpoint save of that step,
after its shards are written and before the commit ("save").
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import shoal
import shoal.checkpoint.store as store
from shoal.training.settling import settling

N_SAMPLES, FEATURES = 240, 10


class IndexedNet(nn.Module):
    """Ignores the last input column (the sample index) and logs it."""

    def __init__(self, log: list):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.1),
                                  nn.Linear(32, 3))
        self.log = log

    def forward(self, x):
        if self.training and not settling():  # (a resume's settling pass is no step's)
            self.log.extend(x[:, -1].long().tolist())
        return self.body(x[:, :-1])


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N_SAMPLES, FEATURES, generator=g)
    index = torch.arange(N_SAMPLES, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(torch.cat([x, index], dim=1),
                         torch.randint(0, 3, (N_SAMPLES,), generator=g))


def install_kills(plan: list, trainer: shoal.Trainer) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(plan) or plan[attempt] is None:
        return
    rank, step, where = plan[attempt]
    if shoal.rank() != rank:
        return
    if where == "step":
        def after_step(*_):
            if trainer.global_step + 1 == step:  # the hook runs before the counter moves
                os.kill(os.getpid(), signal.SIGKILL)
        trainer.optimizer.register_step_post_hook(after_step)
    else:
        real_save = store.dcp.save

        def save_then_die(*args, **kwargs):
            real_save(*args, **kwargs)
            if trainer.global_step == step:
                os.kill(os.getpid(), signal.SIGKILL)
        store.dcp.save = save_then_die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kills", default="[]")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--no-checkpoints", action="store_true")
    parser.add_argument("--trainer", default="{}",
                        help="more Trainer settings, as JSON (compression, strategy, ...)")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds each step sleeps (a slow job, to be signalled)")
    args = parser.parse_args()
    out = Path(args.out)
    shoal.init("gloo")
    log: list[int] = []
    torch.manual_seed(0)
    model = IndexedNet(log)
    settings = {} if args.no_checkpoints else {
        "checkpoint_dir": str(out / "checkpoints"), "checkpoint_every": args.every,
        "resume": "auto"}
    trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            batch_size=args.batch_size, seed=3, progress=False,
                            accumulate_grad_batches=args.accumulate, **settings,
                            **json.loads(args.trainer))
    install_kills(json.loads(args.kills), trainer)
    steps_logged = []

    def record_step(*_):
        steps_logged.append((trainer.global_step + 1, sorted(log)))
        log.clear()
    trainer.optimizer.register_step_post_hook(record_step)
    if args.step_sleep:
        def slow_down(*_):
            time.sleep(args.step_sleep)
            if trainer.global_step + 1 == 3 and shoal.is_main():
                (out / "ready").touch()  # three steps done: a job in full swing
        trainer.optimizer.register_step_post_hook(slow_down)
    result = trainer.fit(dataset(), max_steps=args.steps)
    # Every rank's samples of every step of this attempt, merged on rank 0.
    # Every rank's own final state: under local_sgd / diloco the replicas differ.
    torch.save({"model": trainer.module.state_dict(),
                "optimizer": trainer.optimizer.state_dict(),
                "comm": trainer.harness.comm_state_dict()},
               out / f"final_rank{shoal.rank()}.pt")
    everyone = shoal.all_gather_object(steps_logged)
    if shoal.is_main():
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        merged = {}
        for rank_steps in everyone:
            for step, samples in rank_steps:
                merged.setdefault(step, []).extend(samples)
        (out / f"samples_attempt{attempt}.json").write_text(
            json.dumps({s: sorted(v) for s, v in merged.items()}))
        torch.save({"model": trainer.module.state_dict(),
                    "optimizer": trainer.optimizer.state_dict(),
                    "rng": torch.get_rng_state(), "train_loss": result["train_loss"]},
                   out / "final.pt")


if __name__ == "__main__":
    main()
