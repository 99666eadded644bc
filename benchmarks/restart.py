"""How soon a restarted worker trains again, measured on this machine.

A 2-process job under `shoal run --max-restarts K` with checkpoints every step; in each
attempt, one rank (alternating) kills itself with SIGKILL a few steps after resuming. Recovery
time = from the kill to the first completed optimizer step after the restart (detection,
stopping the group, new processes, rendezvous, loading the checkpoint, the step itself).
Medians over --kills kills (target <= 2 s), with the workers forked from the launcher's
preloaded server (the default) and, side by side, started as new processes (--no-preload),
with the parts of the time: kill -> the script's first line, -> process group joined, ->
first step. (benchmarks/recovery.py compares today's restart with live recovery.)

    python benchmarks/restart.py [--kills 3]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(Path(args.job), args.kills)
    report_recovery(args.kills)
    return None


if __name__ == "__main__":
    main()
