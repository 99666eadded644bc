"""Recovery and checkpoint-save figures, measured on this machine.

1. Recovery: a 2-process job under `shoal run --max-restarts K` with checkpoints every step;
   in each attempt, one rank (alternating) kills itself with SIGKILL a few steps after
   resuming. Recovery time = from the kill to the first completed optimizer step after the
   restart (detection, stopping the group, new processes, rendezvous, loading the
   checkpoint, the step itself). Median over --kills kills (target <= 5 s), with the workers
   forked from the launcher's preloaded server (the default) and, side by side, started as
   new processes (--no-preload), with the parts of the time: kill -> the script's first line,
   -> process group joined, -> first step.
2. Save: a model + AdamW state of --state-mb megabytes (>= 500), saved by one process:
   synchronous save time, asynchronous save's blocking time (target <= 10 % of the
   synchronous time; after a first save that allocates the reused copy buffers) and total
   time, and save throughput against the disk's raw write
   speed measured in the same run with dd (conv=fdatasync), --repeats times, medians.

    python benchmarks/recovery.py [--kills 5] [--state-mb 540] [--repeats 3] [--no-save]
"""

# ruff: noqa: E402
import time

SCRIPT_START = time.time()  # in a restarted worker: before it imports anything

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn


def job(out: Path, kills: int) -> None:
    """The training job of part 1, run by `shoal run` (this file with --job)."""
    import shoal
    from shoal.examples.digits import build_data, build_model

    shoal.init("gloo")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if shoal.is_main():
        (out / f"started_{attempt}").write_text(f"{SCRIPT_START!r} {time.time()!r}")
    model = build_model(hidden=256)
    trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            batch_size=32, progress=False, checkpoint_dir=str(out / "ckpt"),
                            checkpoint_every=1, resume="auto")
    marks = {"first": None}

    def after_step(*_):
        if marks["first"] is None:
            marks["first"] = time.time()
            if shoal.is_main():
                (out / f"first_step_{attempt}").write_text(repr(marks["first"]))
        if trainer.global_step + 1 != marks.setdefault("start", trainer.global_step) + 5:
            return
        if attempt == kills:
            sys.exit(0)  # every rank at the same step: nothing more to measure
        if shoal.rank() == attempt % 2:
            (out / f"kill_{attempt}").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    trainer.optimizer.register_step_post_hook(after_step)
    trainer.fit(build_data()[0], max_steps=1000)


def measure_recovery(kills: int, preload: bool) -> dict[str, list[float]]:
    """Seconds from each kill to the restarted job's first step, and to the parts before."""
    out = Path(tempfile.mkdtemp(prefix="shoal-recovery-"))
    cmd = [sys.executable, "-m", "shoal", "run", "--nproc-per-node", "2", "--max-restarts",
           str(kills), *([] if preload else ["--no-preload"]), __file__, "--job", str(out),
           "--kills", str(kills)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    times = {"script": [], "group": [], "step": []}
    for a in range(kills):
        kill = float((out / f"kill_{a}").read_text())
        script, group = map(float, (out / f"started_{a + 1}").read_text().split())
        times["script"].append(script - kill)
        times["group"].append(group - kill)
        times["step"].append(float((out / f"first_step_{a + 1}").read_text()) - kill)
    shutil.rmtree(out, ignore_errors=True)
    return times


def report_recovery(kills: int) -> None:
    # Alternating, so that the machine's load drifts over both alike.
    runs = {True: {}, False: {}}
    for _ in range(2):
        for preload in (True, False):
            for part, values in measure_recovery(kills, preload).items():
                runs[preload].setdefault(part, []).extend(values)
    print(f"recovery: SIGKILL of a rank -> first completed step after restart, 2 processes, "
          f"{2 * kills} kills each (medians, s)")
    print("                         script starts  group joined  first step")
    for preload, label in ((True, "forked (default)"), (False, "new process (--no-preload)")):
        med = {part: statistics.median(v) for part, v in runs[preload].items()}
        print(f"  {label:27s} {med['script']:6.2f}  {med['group']:12.2f}  {med['step']:10.2f}")
    ratio = statistics.median(runs[False]["step"]) / statistics.median(runs[True]["step"])
    print("  each, forked:      " + " ".join(f"{t:.2f}" for t in runs[True]["step"]))
    print("  each, new process: " + " ".join(f"{t:.2f}" for t in runs[False]["step"]))
    print(f"  forked restarts reach the first step {ratio:.1f}x sooner (target <= 2 s)")


def big_state(megabytes: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose parameters plus AdamW state (3 copies) take about ``megabytes``."""
    width = 2048
    layers = max(1, round(megabytes * 2**20 / (3 * 4 * width * width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def dd_seconds(directory: Path, megabytes: int) -> float:
    target = directory / "dd.bin"
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=4M",
                    f"count={max(1, megabytes // 4)}", "conv=fdatasync"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    target.unlink()
    return elapsed


def measure_save(megabytes: int, repeats: int) -> dict:
    import shoal
    from shoal.checkpoint import CheckpointStore

    shoal.init("gloo")
    model, optimizer = big_state(megabytes)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
        if torch.is_tensor(v))
    root = Path(tempfile.mkdtemp(prefix="shoal-save-", dir=os.environ.get("TMPDIR", "/tmp")))
    results = {"sync": [], "async_block": [], "async_total": [], "dd": []}
    async_store = CheckpointStore(root / "async", keep_last=1, async_save=True)
    start = time.perf_counter()
    async_store.save(-1, state, {}, {})  # the first save also allocates the copy buffers
    first_block = time.perf_counter() - start
    async_store.wait()
    for r in range(repeats):
        results["dd"].append(dd_seconds(root, size // 2**20))
        store = CheckpointStore(root / "sync", keep_last=1)
        start = time.perf_counter()
        store.save(r, state, {}, {})
        results["sync"].append(time.perf_counter() - start)
        start = time.perf_counter()
        async_store.save(r, state, {}, {})
        results["async_block"].append(time.perf_counter() - start)
        async_store.wait()
        results["async_total"].append(time.perf_counter() - start)
    shutil.rmtree(root, ignore_errors=True)
    shoal.cleanup()
    return {"bytes": size, "async_first_block": first_block,
            **{k: statistics.median(v) for k, v in results.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--state-mb", type=int, default=540)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-save", action="store_true",
                        help="measure recovery only, not the checkpoint save")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(Path(args.job), args.kills)
    report_recovery(args.kills)
    if args.no_save:
        return
    save = measure_save(args.state_mb, args.repeats)
    mb = save["bytes"] / 2**20
    print(f"checkpoint save: {mb:.0f} MB (model + AdamW state), 1 process, median of "
          f"{args.repeats}")
    print(f"  synchronous save:        {save['sync']:.2f} s  ({mb / save['sync']:.0f} MB/s)")
    print(f"  raw disk write (dd):     {save['dd']:.2f} s  ({mb / save['dd']:.0f} MB/s); "
          f"save reaches {save['dd'] / save['sync']:.0%} of it")
    print(f"  asynchronous, blocking:  {save['async_block']:.2f} s  "
          f"({save['async_block'] / save['sync']:.0%} of synchronous; target <= 10 %)")
    print(f"  asynchronous, total:     {save['async_total']:.2f} s")
    print(f"  asynchronous, first save blocking (allocates the copy buffers): "
          f"{save['async_first_block']:.2f} s")


if __name__ == "__main__":
    main()
