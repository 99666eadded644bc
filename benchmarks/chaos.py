"""Faults at random moments, long schedules: each setting (mode x compression or strategy)
trained once without faults and once per seed under a seeded schedule of faults, and
whether each mode's promise held (shoal.chaos.trial).

The digits job (examples/digits.yaml) on --groups replica groups of --group-size processes
(under restarts, one job of as many processes), --epochs epochs, a checkpoint every
--checkpoint-every steps; each schedule: --kills SIGKILLs of random workers and --stops
SIGSTOPs of a few seconds, --gap seconds apart, a lighthouse kill and a group launcher kill
(live modes, --extras), and a kill after the last step. The seed of each schedule is
printed: `--seeds 7` replays it.

    python benchmarks/chaos.py [--seeds 1,2,3] [--modes restart,exact,available]
                               [--what none,fp16,powersgd,topk,local_sgd,diloco]
                               [--groups 3] [--group-size 2] [--epochs 60]
                               [--checkpoint-every 50] [--kills 6] [--stops 1]
                               [--extras] [--json FILE] [--keep DIR]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from shoal.chaos import Schedule
from shoal.chaos.trial import MODES, Setting, broken, trial

WHAT = ("none", "fp16", "powersgd", "topk", "local_sgd", "diloco")


def _setting(mode: str, what: str, args: argparse.Namespace) -> Setting:
    strategy = what if what in ("local_sgd", "diloco") else "ddp"
    return Setting(mode, compression="none" if strategy != "ddp" else what, strategy=strategy,
                   groups=args.groups, group_size=args.group_size, epochs=args.epochs,
                   checkpoint_every=args.checkpoint_every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--what", default=",".join(WHAT))
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--stops", type=int, default=1)
    parser.add_argument("--gap", default="0.3,3", help="seconds between faults: LOW,HIGH")
    parser.add_argument("--extras", action="store_true",
                        help="also kill the lighthouse and a group's launcher (live modes)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--keep", default=None, help="keep every run's folder here")
    args = parser.parse_args()
    gap = tuple(float(x) for x in args.gap.split(","))
    root = Path(args.keep or tempfile.mkdtemp(prefix="shoal-chaos-"))
    results = []
    try:
        for mode in args.modes.split(","):
            for what in args.what.split(","):
                setting = _setting(mode, what, args)
                folder = root / setting.name.replace(" ", "-")
                calm = trial(setting, folder / "calm", Schedule(0))
                if not calm.run.ended or calm.metrics is None:
                    print(f"{setting.name}: the run without faults failed "
                          f"(exit {calm.run.returncode}); see {folder / 'calm'}", flush=True)
                    continue
                last = calm.metrics["global_step"]
                for seed in (int(s) for s in args.seeds.split(",")):
                    live = mode != "restart"
                    schedule = Schedule.draw(
                        seed, groups=args.groups if live else None,
                        ranks=args.group_size if live else args.groups * args.group_size,
                        kills=args.kills, stops=args.stops, gap=gap,
                        lighthouse=int(args.extras and live),
                        launchers=int(args.extras and live), after_end=True)
                    outcome = trial(setting, folder / f"seed{seed}", schedule, last_step=last)
                    problems = broken(setting, outcome, calm)
                    results.append({"setting": setting.name, "seed": seed,
                                    "faults": len(outcome.run.fired),
                                    "seconds": round(outcome.run.seconds, 1),
                                    "calm_seconds": round(calm.run.seconds, 1),
                                    "held": not problems, "problems": problems,
                                    "schedule": str(schedule)})
                    verdict = "held" if not problems else "BROKEN: " + "; ".join(problems)
                    print(f"{setting.name:<22} seed {seed:<4} {len(outcome.run.fired)} faults "
                          f"{outcome.run.seconds:6.1f} s (calm {calm.run.seconds:.1f} s)  "
                          f"{verdict}", flush=True)
                    if problems:
                        print(f"  {schedule}\n  " + "\n  ".join(outcome.run.log), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    held = sum(r["held"] for r in results)
    print(f"\n{held} of {len(results)} schedules held their mode's promise "
          f"({args.groups} groups x {args.group_size}, {args.epochs} epochs, "
          f"{args.kills} kills and {args.stops} stops a schedule, gap {args.gap} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
