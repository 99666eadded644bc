"""Overhead of shoal's Trainer over a hand-written DistributedDataParallel loop.

Inside one job of ``--nproc`` processes (gloo on CPU) it alternates runs of a raw DDP loop, of
``shoal.Trainer.fit`` (step metrics on, the default), of the Trainer with metrics off and
of the Trainer with callbacks on (early stopping, idle without validation data, and an
observer of every step),
``--repeats`` times each (which one goes first rotates too). Every
run starts from the same seeded MLP (``shoal.examples.digits``) and AdamW optimizer and trains
``--steps`` steps on the digits data with the Trainer's own math: DistributedSampler (shuffle,
seed, set_epoch), ``--batch-size`` per rank, cross-entropy, ``optimizer.step()``,
``zero_grad(set_to_none=True)``, and DistributedDataParallel with torch's defaults on both
sides. Two figures per run: the median interval between consecutive optimizer steps (taken
by the same optimizer hook on both sides; robust to the noise of a shared machine) and the
whole loop between two barriers (which also counts per-epoch work; DataLoader construction
included on both sides, model, optimizer and DDP construction on neither). It prints the
median over repeats of the Trainer/raw ratios of each (target <= 1.02), the metrics on/off
ratios (target <= 1.02), and whether every run
ended with bit-identical weights and optimizer state. A measurement, not a test: exits 0.

    python benchmarks/overhead.py [--nproc 2] [--repeats 7] [--steps 80] [--hidden 512]
                                  [--batch-size 64]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 processes on 2 cores: no oversubscription

import argparse
import functools
import gc
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import shoal
from shoal.examples.digits import build_data, build_model

SEED = 0


def fresh(hidden: int, stamps: list[float]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Seeded model and optimizer; ``stamps`` gets the time at the end of every step."""
    model = build_model(hidden=hidden, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    return model, optimizer


def run_raw(data, steps: int, hidden: int, batch_size: int, stamps: list[float]):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = fresh(hidden, stamps)
    shoal.seed_everything(SEED + rank)  # as Trainer.__init__ does, after the model is built
    ddp = DistributedDataParallel(model)
    dist.barrier()
    start = time.perf_counter()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    ddp.train()
    step = epoch = 0
    while step < steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = F.cross_entropy(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step >= steps:
                break
        epoch += 1
    dist.barrier()
    return time.perf_counter() - start, model, optimizer


class Observer(shoal.Callback):
    """Looks at every step's figures (and says it never stops the run)."""

    stops = False

    def __init__(self):
        self.last = 0.0

    def on_step_end(self, trainer, metrics):
        self.last = metrics["loss"]


def run_trainer(data, steps: int, hidden: int, batch_size: int, stamps: list[float],
                metrics: bool = True, callbacks: bool = False):
    model, optimizer = fresh(hidden, stamps)
    trainer = shoal.Trainer(model, optimizer, batch_size=batch_size, seed=SEED, progress=False,
                            metrics={"enabled": metrics},
                            callbacks=[shoal.EarlyStopping(), Observer()] if callbacks else [])
    dist.barrier()
    start = time.perf_counter()
    trainer.fit(data, max_steps=steps)
    dist.barrier()
    return time.perf_counter() - start, trainer.module, optimizer


def differences(a, b) -> list[str]:
    """Names of the weights and optimizer-state tensors that are not bitwise equal."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    weights_b = model_b.state_dict()
    diff = [k for k, v in model_a.state_dict().items() if not torch.equal(v, weights_b[k])]
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for i, entry in state_a.items():
        for k, v in entry.items():
            other = state_b[i][k]
            if not (torch.equal(v, other) if torch.is_tensor(v) else v == other):
                diff.append(f"optimizer.state[{i}][{k!r}]")
    return diff


def worker(repeats: int, steps: int, hidden: int, batch_size: int) -> dict:
    shoal.init()
    data, _ = build_data()
    runners = {"raw": run_raw, "trainer": run_trainer,
               "no_metrics": functools.partial(run_trainer, metrics=False),
               "callbacks": functools.partial(run_trainer, callbacks=True)}
    for name in runners:  # warm-up round, untimed: first-use costs land here
        runners[name](data, steps, hidden, batch_size, [])
    times: dict[str, list[float]] = {name: [] for name in runners}
    step_medians: dict[str, list[float]] = {name: [] for name in runners}
    reference, diffs = None, set()
    names = list(runners)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each first in turn
            gc.collect()  # the previous run's garbage is not collected inside this one's timing
            stamps: list[float] = []
            elapsed, model, optimizer = runners[name](data, steps, hidden, batch_size, stamps)
            times[name].append(elapsed)
            step_medians[name].append(statistics.median(
                b - a for a, b in zip(stamps, stamps[1:], strict=False)))
            if reference is None:
                reference = (model, optimizer)
            else:
                diffs.update(f"{name}: {d}" for d in differences(reference, (model, optimizer)))
    shoal.cleanup()
    return {"times": times, "steps": step_medians, "diffs": sorted(diffs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    results = shoal.spawn(worker, nprocs=args.nproc,
                          args=(args.repeats, args.steps, args.hidden, args.batch_size))
    # A run lasts as long as its slowest rank (the closing barrier makes them nearly equal).
    names = ("raw", "trainer", "no_metrics", "callbacks")
    whole = {name: [max(res["times"][name][i] for res in results) / args.steps
                    for i in range(args.repeats)] for name in names}
    step = {name: [max(res["steps"][name][i] for res in results)
                   for i in range(args.repeats)] for name in names}

    def ratio(d: dict, a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(d[a], d[b], strict=True))
    diffs = sorted({d for res in results for d in res["diffs"]})
    print(f"overhead: Trainer vs raw DDP, {args.nproc} processes, {args.repeats} interleaved "
          f"repeats x {args.steps} steps (hidden {args.hidden}, batch {args.batch_size}/rank)")
    for label, name in (("raw DDP loop            ", "raw"),
                        ("shoal Trainer           ", "trainer"),
                        ("shoal Trainer, no metrics", "no_metrics"),
                        ("shoal Trainer, callbacks", "callbacks")):
        print(f"{label}: median step {statistics.median(step[name]) * 1e3:.3f} ms, "
              f"whole run {statistics.median(whole[name]) * 1e3:.3f} ms/step")
    print(f"Trainer/raw, median step interval: {ratio(step, 'trainer', 'raw'):.3f}  "
          "(target <= 1.02)")
    print(f"Trainer/raw, whole run per step:   {ratio(whole, 'trainer', 'raw'):.3f}  "
          "(noisier; counts per-epoch work)")
    print(f"metrics on/off, median step interval: {ratio(step, 'trainer', 'no_metrics'):.3f}"
          f", whole run: {ratio(whole, 'trainer', 'no_metrics'):.3f}  (target <= 1.02)")
    print(f"callbacks/raw, median step interval: {ratio(step, 'callbacks', 'raw'):.3f}, "
          f"whole run: {ratio(whole, 'callbacks', 'raw'):.3f}  (target <= 1.05)")
    print(f"final weights bit-identical: {'no' if diffs else 'yes'}"
          " (weights and AdamW state, all runs, all ranks)")
    for d in diffs:
        print(f"  differs: {d}")


if __name__ == "__main__":
    main()
