"""Which communication option to pick: accuracy, bytes and speed of each, side by side.

Trains the digits classifier (``shoal.examples.digits``, an MLP of ``--hidden`` units) with
``shoal.Trainer`` on ``--nproc`` processes (gloo) under each option below, with the same
seed, data order, AdamW optimizer and sample budget (``--epochs`` over the training split).
Runs are interleaved over ``--repeats`` rounds (this machine is shared and noisy) and the
table shows per option: final validation accuracy, bytes each rank sent per optimizer step
(counted where they are sent, over the whole run, warm-up included), that figure's
reduction against plain DDP, the median time per step and throughput relative to plain DDP.
A measurement, not a test: exits 0.

    python benchmarks/communication.py [--nproc 2] [--epochs 32] [--hidden 512]
                                       [--repeats 2] [--only topk-1%,diloco-H32]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 processes on 2 cores: no oversubscription

import argparse
import statistics
import time

import torch

import shoal
from shoal.examples.digits import build_data, build_model

OPTIONS = {
    "ddp": {},
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16"},
    "powersgd-r1": {"compression": {"name": "powersgd", "rank": 1, "warmup_steps": 2}},
    "powersgd-r4": {"compression": {"name": "powersgd", "rank": 4, "warmup_steps": 2}},
    "topk-1%": {"compression": {"name": "topk", "ratio": 0.01}},
    "topk-0.1%": {"compression": {"name": "topk", "ratio": 0.001}},
    "local_sgd-H8": {"strategy": "local_sgd", "local_sgd": {"period": 8}},
    "local_sgd-H32": {"strategy": "local_sgd", "local_sgd": {"period": 32}},
    "diloco-H32": {"strategy": "diloco", "diloco": {"period": 32}},  # outer lr 0.7, mom. 0.9
    # DiLoCo's defaults suit thousands of outer steps; this run has 23: less momentum.
    "diloco-H32-m0.5": {"strategy": "diloco", "diloco": {"period": 32, "outer_momentum": 0.5}},
}


def train(settings: dict, epochs: int, hidden: int, batch_size: int) -> dict[str, float]:
    shoal.init("gloo")
    train_data, val_data = build_data(seed=0)
    model = build_model(hidden=hidden, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    trainer = shoal.Trainer(model, optimizer, batch_size=batch_size, seed=0, progress=False,
                            **settings)
    stamps: list[float] = []
    optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    torch.distributed.barrier()
    trainer.fit(train_data, epochs=epochs)
    metrics = trainer.validate(val_data)
    traffic = trainer.harness.traffic
    intervals = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"val_accuracy": metrics["val_accuracy"],
            "bytes_per_step": traffic.total_bytes / traffic.steps,
            "wait_per_step": traffic.total_wait / traffic.steps,
            "step_time": statistics.median(intervals), "steps": traffic.steps,
            "samples_per_step": batch_size * shoal.world_size()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=32,
                        help="32 x 23 steps: a whole number of periods of 8 and 32")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", help="comma-separated option names (ddp is always run)")
    args = parser.parse_args()
    names = list(OPTIONS) if not args.only else ["ddp", *(
        n for n in args.only.split(",") if n != "ddp")]
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        parser.error(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            results = shoal.spawn(train, nprocs=args.nproc, args=(
                OPTIONS[name], args.epochs, args.hidden, args.batch_size))
            runs[name].append({**results[0], "step_time": max(r["step_time"] for r in results)})
    base = runs["ddp"]
    base_bytes = base[0]["bytes_per_step"]
    base_time = statistics.median(r["step_time"] for r in base)
    n_params = sum(p.numel() for p in build_model(hidden=args.hidden).parameters())
    print(f"communication: digits MLP ({n_params:,} parameters, fp32), {args.nproc} processes "
          f"(gloo), batch {args.batch_size}/process, {args.epochs} epochs "
          f"({base[0]['steps']} steps), median of {args.repeats} interleaved runs")
    header = (f"{'option':<16} {'val acc':>8} {'bytes/step':>11} {'reduction':>10} "
              f"{'wait ms':>8} {'step ms':>8} {'step time':>10} {'throughput':>11}")
    print(header)
    print("-" * len(header))
    for name in names:
        rs = runs[name]
        step_time = statistics.median(r["step_time"] for r in rs)
        accuracy = statistics.median(r["val_accuracy"] for r in rs)
        sent = rs[0]["bytes_per_step"]
        wait = statistics.median(r["wait_per_step"] for r in rs) * 1e3
        print(f"{name:<16} {accuracy:>8.2%} {sent:>11,.0f} {base_bytes / sent:>9.1f}x "
              f"{wait:>8.2f} {step_time * 1e3:>8.2f} {step_time / base_time:>9.2f}x "
              f"{base_time / step_time:>10.2f}x")
    print("step time and throughput are relative to ddp (throughput > 1: faster); "
          "bytes are per rank, ring model (see shoal.parallel.traffic)")


if __name__ == "__main__":
    main()
