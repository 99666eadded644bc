"""All-reduce bandwidth on the job's backend, as nccl-tests report it.

Run on every rank by ``shoal bench allreduce``. For each message size: ``warmup`` untimed
all-reduces, then ``iters`` timed ones between barriers; the time is the slowest rank's mean.
Algorithm bandwidth is size / time; bus bandwidth is algorithm bandwidth x 2(n-1)/n, the
bytes each rank moves in a ring all-reduce, comparable across world sizes.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
import torch.distributed as dist

from shoal.runtime import dist as rt

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'64', '4K', '256M', '1G' (powers of 1024) to bytes."""
    match = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4K, 256M)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def sizes(smallest: int, largest: int, factor: int) -> list[int]:
    out, size = [], smallest
    while size <= largest:
        out.append(size)
        size *= factor
    return out


def measure(nbytes: int, iters: int, warmup: int, device: torch.device) -> float:
    """Seconds per all-reduce of ``nbytes`` of fp32, the slowest rank's mean."""
    tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def bandwidths(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in bytes/s of an all-reduce of ``nbytes`` in ``seconds``."""
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shoal.bench.allreduce")
    parser.add_argument("--min-size", type=parse_size, default=parse_size("1K"))
    parser.add_argument("--max-size", type=parse_size, default=parse_size("256M"))
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    env = rt.init()
    device = rt.device()
    n = env.world_size
    rows = []
    for nbytes in sizes(args.min_size, args.max_size, args.factor):
        # Fewer repetitions for large messages: each is already long enough to time.
        iters = max(2, min(args.iters, int(args.iters * 2**22 / max(nbytes, 1))))
        seconds = measure(nbytes, iters, min(args.warmup, iters), device)
        algbw, busbw = bandwidths(nbytes, seconds, n)
        rows.append({"bytes": nbytes, "seconds": seconds, "algbw_GBps": algbw / 1e9,
                     "busbw_GBps": busbw / 1e9})
    if env.rank == 0:
        print(f"all-reduce, fp32, {n} processes, backend {dist.get_backend()}, "
              f"device {device.type}")
        print(f"{'size':>10} {'time us':>12} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for r in rows:
            print(f"{human(r['bytes']):>10} {r['seconds'] * 1e6:>12.1f} "
                  f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": n, "backend": dist.get_backend(), "rows": rows}, f,
                          indent=1)
    rt.cleanup()


if __name__ == "__main__":
    main()
