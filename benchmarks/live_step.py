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

--scheduling instead times each mode's step (its median) under `shoal run --scheduling
normal` and under the default batch policy (SCHED_BATCH), rotated as above, with each
live mode against DDP under each policy.

--cpu instead reads the CPU time of every process and thread of each mode's job (Linux's
/proc) between the step past --skip and the last step, one run a mode: each as a share of
one core, and how often a worker's main thread was made to wait for a core while it could
run (involuntary switches, a step): what a live job's other processes and threads (its
lighthouse, a launcher a group, torchft's threads in each worker) take from its workers
where they share the cores.

    python benchmarks/live_step.py [--rounds 5] [--steps 3000] [--compression topk]
                                   [--calls | --cpu | --scheduling]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
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


def job(out: Path, steps: int, compression: str, calls_from: int | None = None,
        cpu_from: int | None = None) -> None:
    """The digits job of `recovery.py`, each step's marks written to
    ``out/marks.<worker>.json`` (``calls_from``: instead, the Python calls a step from
    that step to the last one's forward, to ``out/calls.<worker>.json``; ``cpu_from``:
    instead, ``out/at.<first|last>.<worker>`` written at that step's forward and the last
    one's, with the worker's pid, for ``cpu`` to read /proc then)."""
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
    if cpu_from is not None:
        forwards = 0

        def at(*_):
            nonlocal forwards
            forwards += 1
            if forwards in (cpu_from, steps):
                name = "first" if forwards == cpu_from else "last"
                (out / f"at.{name}.{worker}").write_text(str(os.getpid()))
                while not (out / f"read.{name}").exists():  # (a hang guard: the run's own)
                    time.sleep(0.001)

        model.register_forward_pre_hook(at)
        return trainer.fit(build_data()[0])
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


def _command(mode: str, out: Path, steps: int, compression: str,
             extra: tuple[str, ...] = (), scheduling: str = "batch") -> list[str]:
    """`shoal run` of the job in ``mode`` (its processes scheduled as ``scheduling``),
    writing to ``out``."""
    return [sys.executable, "-m", "shoal", "run", *MODES[mode], "--scheduling", scheduling,
            __file__, "--job", str(out), "--steps", str(steps), "--compression", compression,
            *extra]


def _job_output(mode: str, steps: int, compression: str, name: str,
                extra: tuple[str, ...] = (), scheduling: str = "batch") -> list:
    """One run of the job in ``mode``: what each of its workers wrote to ``name.*.json``."""
    out = Path(tempfile.mkdtemp(prefix="shoal-live-step-"))
    try:
        with open(out / "output.txt", "wb") as output:
            subprocess.run(_command(mode, out, steps, compression, extra, scheduling),
                           check=True, stdout=output, stderr=subprocess.STDOUT)
        return [json.loads(path.read_text()) for path in sorted(out.glob(f"{name}.*.json"))]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run(mode: str, steps: int, compression: str, skip: int, scheduling: str = "batch"
        ) -> dict[str, float]:
    """One run of the job in ``mode``: each phase's figure, the mean of its workers'."""
    workers = [phases(marks, skip) for marks in
               _job_output(mode, steps, compression, "marks", scheduling=scheduling)]
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


def _threads(root: int) -> dict[tuple[int, int], tuple[str, str, int, int]]:
    """Every thread of ``root`` and of the processes under it, (pid, tid): (the process's
    command line, the thread's name, its CPU ticks (user and system), its involuntary
    switches)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]),
                                    []).append(int(entry))
    pids, found = [root], {}
    for pid in pids:
        pids += children.get(pid, [])
        with contextlib.suppress(OSError):  # (a process that ended meanwhile)
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                switches = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
                found[pid, int(tid)] = (command, stat[stat.index("(") + 1:stat.rindex(")")],
                                        int(fields[11]) + int(fields[12]), switches)
    return found


def cpu_shares(before: dict, after: dict, seconds: float, steps: int, workers: set[int]
               ) -> list[str]:
    """What each part of a job took between two readings of ``_threads`` ``seconds`` and
    ``steps`` apart, as a share of one core: the workers' (pids ``workers``) main threads
    (each's mean, with their involuntary switches a step), their other threads by name
    (each worker's mean), and the other processes by what they run."""
    tick = os.sysconf("SC_CLK_TCK")
    parts: dict[str, float] = {}
    switches = 0
    for key, (command, name, ticks, waits) in after.items():
        if key not in before:
            continue
        share = (ticks - before[key][2]) / tick / seconds * 100
        pid, tid = key
        if pid in workers:
            part = "workers' main threads" if pid == tid else f"workers' {name} threads"
            share /= len(workers)
            if pid == tid:
                switches += waits - before[key][3]
        elif "shoal.ft.lighthouse" in command:
            part = "the lighthouse"
        else:
            part = "the launchers"
        parts[part] = parts.get(part, 0.0) + share
    lines = [f"    {part}: {share:.1f} %" for part, share in
             sorted(parts.items(), key=lambda item: -item[1]) if share >= 0.05]
    lines.append(f"    a worker's main thread made to wait for a core: "
                 f"{switches / len(workers) / steps:.2f} times a step")
    return lines


def cpu(steps: int, compression: str, skip: int) -> list[str]:
    """Each mode's ``cpu_shares``, from one run of it."""
    lines = []
    for mode in MODES:
        out = Path(tempfile.mkdtemp(prefix="shoal-live-step-"))
        with open(out / "output.txt", "wb") as output:
            run_ = subprocess.Popen(
                _command(mode, out, steps, compression, ("--cpu-from", str(skip + 1))),
                stdout=output, stderr=subprocess.STDOUT)
        try:
            readings = []
            for name in ("first", "last"):  # (each worker waits until it is read)
                while len(list(out.glob(f"at.{name}.*"))) < 2 and run_.poll() is None:
                    time.sleep(0.001)
                readings.append((time.perf_counter(), _threads(run_.pid)))
                (out / f"read.{name}").touch()
            if run_.wait() != 0:
                raise RuntimeError(f"{mode}: the job failed: {(out / 'output.txt').read_text()}")
            workers = {int(path.read_text()) for path in out.glob("at.first.*")}
        finally:
            if run_.poll() is None:
                run_.kill()
            shutil.rmtree(out, ignore_errors=True)
        (start, before), (end, after) = readings
        lines += [f"  {mode}:", *cpu_shares(before, after, end - start, steps - skip - 1,
                                            workers)]
    return lines


def measure(rounds: int, steps: int, compression: str, skip: int) -> dict[str, list[dict]]:
    """Every mode's figures, ``rounds`` runs each, the order rotated round by round."""
    modes = list(MODES)
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            results[mode].append(run(mode, steps, compression, skip))
    return results


def scheduling(rounds: int, steps: int, compression: str, skip: int) -> list[str]:
    """Each mode's median step under each of `shoal run`'s ``--scheduling`` policies,
    ``rounds`` runs each (the order rotated round by round), and a live mode's step rate
    against DDP's under the same policy, each round's pair."""
    runs = [(mode, policy) for policy in ("normal", "batch") for mode in MODES]
    steps_of: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for r in range(rounds):
        for mode, policy in runs[r % len(runs):] + runs[:r % len(runs)]:
            steps_of[mode, policy].append(run(mode, steps, compression, skip, policy)["step"])
    lines = []
    for mode in MODES:
        normal, batch = (statistics.median(steps_of[mode, p]) * 1e3 for p in ("normal", "batch"))
        lines.append(f"  {mode}: a step {normal:.3f} ms normal, {batch:.3f} ms batch "
                     f"({normal / batch:.2f} x the step rate)")
        for policy in ("normal", "batch") if mode != "DDP" else ():
            ratios = sorted(d / m for d, m in zip(steps_of["DDP", policy],
                                                  steps_of[mode, policy], strict=True))
            lines.append(f"    {policy}: {statistics.median(ratios):.2f} x DDP's step rate "
                         f"({', '.join(f'{x:.2f}' for x in ratios)})")
    return lines


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
    parser.add_argument("--cpu", action="store_true",
                        help="read each mode's CPU time a process and thread instead")
    parser.add_argument("--scheduling", action="store_true",
                        help="time each mode under `shoal run --scheduling normal` and batch")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--calls-from", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-from", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(Path(args.job), args.steps, args.compression, args.calls_from,
                   args.cpu_from)
    if args.calls or args.cpu:
        what, read = (("the Python calls of a worker's main thread a step", calls)
                      if args.calls else ("CPU time as a share of one core", cpu))
        print(f"{what}, steps {args.skip + 1} to {args.steps}: the digits job, compression "
              f"{args.compression}, 2 live groups of 1 process against 2-process DDP, one "
              "run each")
        print("\n".join(read(args.steps, args.compression, args.skip)))
        return None
    if args.scheduling:
        print(f"a step under each scheduling policy: the digits job, {args.steps} steps, "
              f"compression {args.compression}, 2 live groups of 1 process and 2-process "
              f"DDP, {args.rounds} rounds, median steps past {args.skip}")
        print("\n".join(scheduling(args.rounds, args.steps, args.compression, args.skip)))
        return None
    results = measure(args.rounds, args.steps, args.compression, args.skip)
    print(f"a live step against DDP's: the digits job, {args.steps} steps, compression "
          f"{args.compression}, 2 live groups of 1 process against 2-process DDP, "
          f"{args.rounds} rounds")
    print("\n".join(report(results)))
    return None


if __name__ == "__main__":
    main()
