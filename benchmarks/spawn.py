"""How long `shoal.spawn` takes to start its processes: forked from a server that has
imported torch (what shoal does) against spawned, each importing torch (Python's default).

Each call runs a function on --nproc processes that joins the process group, builds a
small model and an optimizer (which imports torch._dynamo) and does one all-reduce: about
what a test or a notebook cell does. Prints each call's wall time, the first call of each
way apart (it starts the server), side by side in this one run. A measurement, not a test.

    python benchmarks/spawn.py [--nproc 2] [--calls 4]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import time

import torch

import shoal
import shoal.launch.spawn as spawn_module


def one_step() -> float:
    shoal.init("gloo")
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(4, 16)).sum().backward()
    optimizer.step()
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    return float(total)


def timed_calls(nproc: int, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        assert shoal.spawn(one_step, nprocs=nproc) == [float(nproc)] * nproc
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    real = spawn_module.start_method
    spawn_module.start_method = lambda: "spawn"
    spawned = timed_calls(args.nproc, args.calls)
    spawn_module.start_method = real
    forked = timed_calls(args.nproc, args.calls)
    print(f"shoal.spawn of {args.nproc} processes, {args.calls} calls each way, wall time:")
    print(f"  spawned (each imports torch)   first {spawned[0]:5.2f} s, then median "
          f"{statistics.median(spawned[1:]):5.2f} s")
    print(f"  forked from a torch server     first {forked[0]:5.2f} s, then median "
          f"{statistics.median(forked[1:]):5.2f} s  "
          f"({statistics.median(spawned[1:]) / statistics.median(forked[1:]):.0f}x faster)")


if __name__ == "__main__":
    main()
