"""Where a step's time goes without failures: 2 live groups of one process against
2-process DDP, phase by phase, on the digits job of `recovery.py`.

Each run marks every step in each worker with the clock: the model's forward (its hooks),
the loss and what starts before backward (in a live step, the step's numbers), backward
(with DDP's communication hook: under topk the selection and the gather, and the wait for
the other worker), what comes after backward before the optimizer (in a live step, the
vote), the optimizer's step (its hooks), and the rest until the next forward (the next
batch; in a live step the quorum, reused while nothing changes, and the step's seeds).
Each phase's figure is its median step, past the first --skip; each mode's, the median of
--rounds rounds, whose runs rotate in order (this machine's speed drifts between runs).

--calls instead counts the Python calls of each worker's main thread a step (cProfile's,
from the step past --skip to the last step's forward), one run a mode: the work a live step
adds, in a figure that this machine's noise does not move (its times drift by more than the
5 % a live step may cost).

    python benchmarks/live_step.py [--rounds 5] [--steps 3000] [--compression topk] [--calls]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import cProfile
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = {"DDP": ["--nproc-per-node", "2"],
         "live exact": ["--replica-groups", "2", "--ft-policy", "exact"],
         "live available": ["--replica-groups", "2", "--ft-policy", "available"]}
MARKS = ("forward", "forward_end", "backward", "backward_end", "optimizer", "optimizer_end")
PHASES = ("forward", "loss", "backward", "after backward", "optimizer", "between steps")
"""Each from one mark to the next (the last: to the next step's forward)."""


def job(out: Path, steps: int, compression: str, calls_from: int | None = None) -> None:
    """The digits job of `recovery.py`, each step's marks written to
    ``out/marks.<worker>.json`` (``calls_from``: instead, the Python calls a step from
    that step to the last one's forward, to ``out/calls.<worker>.json``)."""
    import shoal
    from shoal.examples.digits import build_data, build_model

    shoal.init("gloo")
    worker = int(os.environ.get("SHOAL_FT_GROUP", shoal.rank()))
    model = build_model(hidden=256)
    trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            batch_size=32, progress=False, max_steps=steps,
                            metrics={"enabled": False}, compression=compression)
    if calls_from is not None:
        return _count_calls(out / f"calls.{worker}.json", trainer, model, calls_from, steps)
    marks: dict[str, list[float]] = {name: [] for name in MARKS}
    clock = time.perf_counter

    def mark(name: str):
        return lambda *_: marks[name].append(clock())

    model.register_forward_pre_hook(mark("forward"))
    model.register_forward_hook(mark("forward_end"))
    trainer.optimizer.register_step_pre_hook(mark("optimizer"))
    trainer.optimizer.register_step_post_hook(mark("optimizer_end"))
    backward = torch.Tensor.backward

    def marked_backward(self, *args, **kwargs):  # (this job's process only)
        marks["backward"].append(clock())
        backward(self, *args, **kwargs)
        marks["backward_end"].append(clock())

    torch.Tensor.backward = marked_backward  # type: ignore[method-assign]
    trainer.fit(build_data()[0])
    (out / f"marks.{worker}.json").write_text(json.dumps(marks))


def _count_calls(path: Path, trainer, model: torch.nn.Module, first: int, last: int) -> None:
    """The main thread's Python calls from step ``first``'s forward to step ``last``'s
    (1-based), a step, to ``path``."""
    from shoal.examples.digits import build_data

    profile = cProfile.Profile()
    forwards = 0

    def count(*_):
        nonlocal forwards
        forwards += 1
        if forwards == first:
            profile.enable()
        elif forwards == last:
            profile.disable()

    model.register_forward_pre_hook(count)
    trainer.fit(build_data()[0])
    calls = profile.getstats()
    path.write_text(json.dumps(sum(entry.callcount for entry in calls) / (last - first)))


def phases(marks: dict[str, list[float]], skip: int) -> dict[str, float]:
    """Each phase's median (seconds) over the steps past the first ``skip``, and the
    step's ('step': from a forward to the next). Only steps marked whole count: the last
    one has no next forward."""
    steps = min(len(marks[name]) for name in MARKS) - 1
    if steps <= skip:
        raise ValueError(f"{steps} steps marked, not more than the {skip} skipped")
    order = [*MARKS, "forward"]
    figures = {}
    for i, phase in enumerate(PHASES):
        start, end = marks[order[i]], marks[order[i + 1]]
        shift = 1 if i == len(PHASES) - 1 else 0  # (to the next step's forward)
        figures[phase] = statistics.median(end[s + shift] - start[s]
                                           for s in range(skip, steps))
    forward = marks["forward"]
    figures["step"] = statistics.median(forward[s + 1] - forward[s] for s in range(skip, steps))
    return figures


def _job_output(mode: str, steps: int, compression: str, name: str,
                extra: tuple[str, ...] = ()) -> list:
    """One run of the job in ``mode``: what each of its workers wrote to ``name.*.json``."""
    out = Path(tempfile.mkdtemp(prefix="shoal-live-step-"))
    try:
        with open(out / "output.txt", "wb") as output:
            subprocess.run([sys.executable, "-m", "shoal", "run", *MODES[mode], __file__,
                            "--job", str(out), "--steps", str(steps), "--compression",
                            compression, *extra], check=True, stdout=output,
                           stderr=subprocess.STDOUT)
        return [json.loads(path.read_text()) for path in sorted(out.glob(f"{name}.*.json"))]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run(mode: str, steps: int, compression: str, skip: int) -> dict[str, float]:
    """One run of the job in ``mode``: each phase's figure, the mean of its workers'."""
    workers = [phases(marks, skip) for marks in _job_output(mode, steps, compression, "marks")]
    return {name: statistics.fmean(w[name] for w in workers) for name in workers[0]}


def calls(steps: int, compression: str, skip: int) -> list[str]:
    """Each mode's Python calls a step (the mean of its workers'), a live mode's with its
    difference from DDP's."""
    counted = {mode: statistics.fmean(_job_output(mode, steps, compression, "calls",
                                                  ("--calls-from", str(skip + 1))))
               for mode in MODES}
    return [f"  {mode}: {n:.0f} Python calls a step" + ("" if mode == "DDP" else
                                                       f" ({n - counted['DDP']:+.0f})")
            for mode, n in counted.items()]


def measure(rounds: int, steps: int, compression: str, skip: int) -> dict[str, list[dict]]:
    """Every mode's figures, ``rounds`` runs each, the order rotated round by round."""
    modes = list(MODES)
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            results[mode].append(run(mode, steps, compression, skip))
    return results


def report(results: dict[str, list[dict]]) -> list[str]:
    """The table: each phase's median over the rounds (ms), a live mode's with its
    difference from DDP's; then each mode's step against DDP's in the same round."""
    ddp = results["DDP"]
    median = {mode: {name: statistics.median(r[name] for r in runs) for name in runs[0]}
              for mode, runs in results.items()}
    lines = [f"  {'phase (ms, median)':<22}" + "".join(f"{mode:>22}" for mode in results)]
    for name in (*PHASES, "step"):
        cells = []
        for mode in results:
            value = median[mode][name] * 1e3
            delta = value - median["DDP"][name] * 1e3
            cells.append(f"{value:.3f}" if mode == "DDP" else f"{value:.3f} ({delta:+.3f})")
        lines.append(f"  {name:<22}" + "".join(f"{cell:>22}" for cell in cells))
    for mode, runs in results.items():
        if mode == "DDP":
            continue
        ratios = sorted(d["step"] / r["step"] for r, d in zip(runs, ddp, strict=True))
        lines.append(f"  {mode}: {statistics.median(ratios):.2f} x DDP's step rate by the "
                     f"median step ({', '.join(f'{x:.2f}' for x in ratios)})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--skip", type=int, default=200, help="first steps left out")
    parser.add_argument("--compression", default="topk",
                        help="of the job's gradients (none, fp16, bf16, powersgd, topk)")
    parser.add_argument("--calls", action="store_true",
                        help="count each mode's Python calls a step instead of timing it")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--calls-from", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(Path(args.job), args.steps, args.compression, args.calls_from)
    if args.calls:
        print(f"the Python calls of a worker's main thread a step, steps {args.skip + 1} to "
              f"{args.steps}: the digits job, compression {args.compression}, 2 live groups "
              "of 1 process against 2-process DDP, one run each")
        print("\n".join(calls(args.steps, args.compression, args.skip)))
        return None
    results = measure(args.rounds, args.steps, args.compression, args.skip)
    print(f"a live step against DDP's: the digits job, {args.steps} steps, compression "
          f"{args.compression}, 2 live groups of 1 process against 2-process DDP, "
          f"{args.rounds} rounds")
    print("\n".join(report(results)))
    return None


if __name__ == "__main__":
    main()
