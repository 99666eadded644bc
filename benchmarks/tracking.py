"""Cost of logging to MLflow: the Trainer with step metrics, with and without an MLflow run.

Inside one job of ``--nproc`` processes (gloo on CPU) it alternates Trainer runs with the
default step metrics (JSON lines and TensorBoard in a directory) and the same runs logging
to MLflow too (``metrics.mlflow``), ``--repeats`` times each, from the same seeded model
(``shoal.examples.digits``, the step of ``benchmarks/overhead.py``). The MLflow runs write
to a local sqlite store (``--tracking-uri`` for a server): rank 0's sender thread then does
the database work in the training process itself, the dearer case. Two figures per run: the
median interval between optimizer steps and the whole ``fit`` (which includes opening and
ending the MLflow run); it prints the medians of the with/without ratios. A measurement,
not a test: exits 0.

    python benchmarks/tracking.py [--nproc 2] [--repeats 5] [--steps 300] [--every 50]
                                  [--tracking-uri URI]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 processes on 2 cores: no oversubscription

import argparse
import statistics
import tempfile
import time

import torch.distributed as dist
from overhead import SEED, fresh

import shoal
from shoal.examples.digits import build_data


def run(data, steps: int, every: int, directory: str, mlflow: dict | None) -> tuple:
    stamps: list[float] = []
    model, optimizer = fresh(512, stamps)
    trainer = shoal.Trainer(model, optimizer, batch_size=64, seed=SEED, progress=False,
                            metrics={"every": every, "dir": directory, "mlflow": mlflow})
    dist.barrier()
    start = time.perf_counter()
    trainer.fit(data, max_steps=steps)
    dist.barrier()
    step = statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return step, time.perf_counter() - start


def worker(repeats: int, steps: int, every: int, uri: str | None, root: str) -> dict:
    shoal.init()
    os.chdir(root)  # a sqlite store keeps the artifacts in ./mlruns
    data, _ = build_data()
    tracked = {"tracking_uri": uri or f"sqlite:///{root}/mlflow.db", "experiment": "bench"}
    kinds = {"files": None, "mlflow": tracked}
    figures: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    for r in range(repeats + 1):  # the first round warms up (and builds the store)
        for kind in (list(kinds) if r % 2 else list(kinds)[::-1]):
            result = run(data, steps, every, os.path.join(root, f"{kind}{r}"), kinds[kind])
            if r:
                figures[kind].append(result)
    shoal.cleanup()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--tracking-uri", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-tracking-") as root:
        results = shoal.spawn(worker, nprocs=args.nproc, args=(
            args.repeats, args.steps, args.every, args.tracking_uri, root))
    # A run lasts as long as its slowest rank.
    figures = {kind: [tuple(max(res[kind][i][j] for res in results) for j in (0, 1))
                      for i in range(args.repeats)] for kind in ("files", "mlflow")}
    print(f"tracking: Trainer with step metrics, with and without MLflow, {args.nproc} "
          f"processes, {args.repeats} interleaved repeats x {args.steps} steps, a window "
          f"every {args.every} steps, store {args.tracking_uri or 'sqlite (local file)'}")
    for kind in ("files", "mlflow"):
        steps = statistics.median(f[0] for f in figures[kind]) * 1e3
        whole = statistics.median(f[1] for f in figures[kind])
        print(f"{kind:>7}: median step {steps:.3f} ms, whole fit {whole:.2f} s")
    for j, label in ((0, "median step interval"), (1, "whole fit")):
        ratio = statistics.median(m[j] / f[j] for m, f in zip(figures["mlflow"],
                                                               figures["files"], strict=True))
        print(f"with/without MLflow, {label}: {ratio:.3f}")


if __name__ == "__main__":
    main()
