"""The same job under a raw torch DDP loop, Hugging Face Accelerate, Lightning Fabric and shoal.

Each run is a fresh job of ``--nproc`` processes (gloo on CPU; ``shoal.spawn``) that trains
the digits MLP (``--hidden`` units, AdamW, seed 0) for ``--steps`` optimizer steps with
``--batch-size`` samples per process, under one framework. Runs are interleaved over
``--repeats`` rounds, the order rotating each round (this machine is shared and noisy). Per
run: the median interval between optimizer steps (the same optimizer hook everywhere) and
each process's peak resident memory. Prints medians over rounds and the step-time ratio of
each framework to raw torch (shoal's target: <= 1.02), and of raw torch run a second time
(an A/A control: how far from 1 noise alone moves a ratio). shoal runs with its defaults
(step metrics on). A measurement, not a test: exits 0.

Accelerate and Lightning are optional extras, never runtime dependencies of shoal:

    pip install -c constraints.txt -e ".[bench]"
    python benchmarks/peers.py [--nproc 2] [--repeats 5] [--steps 200] [--hidden 512]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 processes on 2 cores: no oversubscription

import argparse
import importlib.util
import resource
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


def _setup(hidden: int, stamps: list[float]):
    model = build_model(hidden=hidden, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    return model, optimizer


def _loop(loader, steps: int, step_fn, set_epoch=None) -> None:
    done = epoch = 0
    while done < steps:
        if set_epoch:
            set_epoch(epoch)
        for inputs, targets in loader:
            step_fn(inputs, targets)
            done += 1
            if done >= steps:
                return
        epoch += 1


def raw(data, steps, hidden, batch, stamps):
    dist.init_process_group("gloo")
    model, optimizer = _setup(hidden, stamps)
    ddp = DistributedDataParallel(model)
    sampler = DistributedSampler(data, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)

    def step(x, y):
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _loop(loader, steps, step, sampler.set_epoch)


def accelerate(data, steps, hidden, batch, stamps):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = _setup(hidden, stamps)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def step(x, y):
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _loop(loader, steps, step, getattr(loader, "set_epoch", None))


def fabric(data, steps, hidden, batch, stamps):
    from lightning.fabric import Fabric

    fab = Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                 strategy="ddp")
    fab.launch()
    model, optimizer = _setup(hidden, stamps)
    model, optimizer = fab.setup(model, optimizer)
    loader = fab.setup_dataloaders(DataLoader(data, batch_size=batch, shuffle=True))

    def step(x, y):
        fab.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _loop(loader, steps, step, getattr(loader.sampler, "set_epoch", None))


def shoal_trainer(data, steps, hidden, batch, stamps):
    model, optimizer = _setup(hidden, stamps)
    trainer = shoal.Trainer(model, optimizer, batch_size=batch, seed=SEED, progress=False)
    trainer.fit(data, max_steps=steps)


# "raw again" is raw torch a second time: its ratio to raw torch is the noise floor.
FRAMEWORKS = {"raw torch": raw, "raw again": raw, "accelerate": accelerate,
              "fabric": fabric, "shoal": shoal_trainer}
MODULES = {"accelerate": "accelerate", "fabric": "lightning"}


def run(name: str, steps: int, hidden: int, batch: int) -> dict[str, float]:
    data, _ = build_data()
    stamps: list[float] = []
    FRAMEWORKS[name](data, steps, hidden, batch, stamps)
    intervals = [b - a for a, b in zip(stamps[10:], stamps[11:], strict=False)]  # warm
    return {"step": statistics.median(intervals),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    names = [n for n in FRAMEWORKS
             if n not in MODULES or importlib.util.find_spec(MODULES[n]) is not None]
    missing = sorted(set(FRAMEWORKS) - set(names))
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            ranks = shoal.spawn(run, nprocs=args.nproc,
                                args=(name, args.steps, args.hidden, args.batch_size))
            results[name].append({"step": max(x["step"] for x in ranks),
                                  "peak_rss_mb": max(x["peak_rss_mb"] for x in ranks)})
    base = [x["step"] for x in results["raw torch"]]
    print(f"peers: digits MLP (hidden {args.hidden}), AdamW, {args.nproc} processes (gloo), "
          f"batch {args.batch_size}/process, {args.steps} steps, {args.repeats} interleaved "
          "rounds; medians")
    print(f"{'framework':<12} {'step ms':>8} {'vs raw torch':>13} {'peak RSS MB':>12}")
    for name in names:
        steps = [x["step"] for x in results[name]]
        ratio = statistics.median(s / b for s, b in zip(steps, base, strict=True))
        rss = statistics.median(x["peak_rss_mb"] for x in results[name])
        print(f"{name:<12} {statistics.median(steps) * 1e3:>8.3f} {ratio:>12.3f}x "
              f"{rss:>12.0f}")
    if missing:
        print(f"not installed, left out: {', '.join(missing)} (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
