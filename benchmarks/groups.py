"""Live recovery as the replica groups grow, on this machine.

1. Without failures: the digits job of benchmarks/recovery.py on R replica groups of one
   process each (forked workers, policy exact), for each R of --groups: the median step
   time of group 0 (after the first fifth of the steps), the full quorums group 0 asked
   the lighthouse for and the share of the run's time of those after the first (the other
   steps reuse the last quorum; the first waits for every group to start), and the step
   time of DDP over as many processes, run just before.
2. With failures: --kill-groups groups (default 16) for about --kill-for seconds, a random
   group's worker SIGKILLed every --kill-every seconds (the next kill waits until the last
   one's replacement has committed a step): kills done, goodput (committed steps per second
   against the same job without kills, from part 1), the survivors' pauses (the longest
   a survivor went without committing a step around a kill) and workers restarted that
   were not killed (target 0).

    python benchmarks/groups.py [--groups 2,4,8,16] [--steps 400] [--kill-groups 16]
                                [--kill-every 10] [--kill-for 120] [--seed 0]
"""

# ruff: noqa: E402
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recovery import _steps as _rows  # every committed step: (time, step, group, pid)

JOB = str(Path(__file__).with_name("recovery.py"))


def _start(out: Path, flags: list[str], steps: int, restarts: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "shoal", "run", *flags, "--max-restarts", str(restarts), JOB,
         "--job", str(out), "--steps", str(steps), "--schedule", "[]"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _median_step(rows: list[tuple[float, int, int, int]]) -> float:
    times = [t for t, _, slot, _ in rows if slot == 0]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps[len(gaps) // 5:])


def _rate(rows: list[tuple[float, int, int, int]]) -> float:
    return len({step for _, step, _, _ in rows}) / (rows[-1][0] - rows[0][0])


def calm(groups: int, steps: int) -> dict:
    """R groups without failures, and R-process DDP just before."""
    figures = {}
    for kind, flags in (("ddp", ["--nproc-per-node", str(groups)]),
                        ("live", ["--replica-groups", str(groups)])):
        out = Path(tempfile.mkdtemp(prefix="shoal-groups-"))
        start = _start(out, flags, steps)
        if start.wait() != 0:
            raise SystemExit(f"the {kind} job failed ({flags})")
        rows = _rows(out)
        figures[kind] = {"step_s": _median_step(rows), "rate": _rate(rows),
                         "run_s": rows[-1][0] - rows[0][0]}
        if kind == "live":
            quorums = json.loads(next(out.glob("quorums.0.*")).read_text())
            figures[kind].update(quorums=quorums["quorums"],
                                 quorum_share=quorums["seconds"] / figures[kind]["run_s"])
        shutil.rmtree(out, ignore_errors=True)
    return {"groups": groups, "step_s": figures["live"]["step_s"],
            "ddp_step_s": figures["ddp"]["step_s"], "quorums": figures["live"]["quorums"],
            "quorum_share": figures["live"]["quorum_share"], "rate": figures["live"]["rate"]}


def with_kills(groups: int, calm_rate: float, every: float, lasting: float, seed: int
               ) -> dict:
    """``groups`` groups under a SIGKILL of a random group's worker every ``every`` s."""
    rng = random.Random(seed)
    kills = int(lasting // every)
    steps = int(calm_rate * (lasting + 2 * every))  # about the kills' span and a margin
    out = Path(tempfile.mkdtemp(prefix="shoal-groups-kills-"))
    process = _start(out, ["--replica-groups", str(groups)], steps, restarts=kills)
    done: list[tuple[float, int, int]] = []  # (time, group, pid)
    try:
        while not list(out.glob("first.*")) and process.poll() is None:
            time.sleep(0.1)
        began = time.time()
        while len(done) < kills and process.poll() is None:
            time.sleep(max(0.0, began + (len(done) + 1) * every - time.time()))
            if done:  # one worker down at a time: the last kill's replacement is back
                last_time, last_group, _ = done[-1]
                while process.poll() is None and not any(
                        float(f.read_text() or 0) > last_time
                        for f in out.glob(f"first.{last_group}.*")):
                    time.sleep(0.05)
            victim = rng.randrange(groups)
            pid = max((int(p.name.split(".")[2]), p.stat().st_mtime)
                      for p in out.glob(f"steps.{victim}.*"))[0]
            if process.poll() is None:
                os.kill(pid, signal.SIGKILL)
                done.append((time.time(), victim, pid))
        if process.wait(timeout=3600) != 0:
            raise SystemExit("the job with kills failed")
    finally:
        if process.poll() is None:
            process.kill()
    rows = _rows(out)
    pauses = [_stall(rows, killed, victim, pid) for killed, victim, pid in done]
    workers = {(slot, pid) for _, _, slot, pid in rows}
    shutil.rmtree(out, ignore_errors=True)
    return {"groups": groups, "kills": len(done), "goodput": _rate(rows) / calm_rate,
            "pause_s": statistics.median(pauses) if pauses else None,
            "max_pause_s": max(pauses) if pauses else None,
            "survivors_restarted": len(workers) - groups - len(done),
            "run_s": rows[-1][0] - rows[0][0]}


def _stall(rows: list[tuple[float, int, int, int]], killed: float, victim: int,
           pid: int) -> float:
    """The survivors' pause for one kill: the longest a survivor went without committing a
    step, over the gaps between its commits that end after the kill and start before the
    replacement's first commit (median over the survivors). A kill from outside lands
    anywhere in a step, also after the victim's share of a step went through and before
    it logged it, so the steps logged around it do not say which step it died in."""
    back = min(t for t, _, slot, p in rows if slot == victim and p != pid and t > killed)
    gaps: dict[int, float] = {}
    times: dict[int, float] = {}
    for t, _, slot, _ in rows:
        if slot != victim:
            if slot in times and t > killed and times[slot] < back:
                gaps[slot] = max(gaps.get(slot, 0.0), t - times[slot])
            times[slot] = t
    return statistics.median(gaps.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="2,4,8,16")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kill-groups", type=int, default=16)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--kill-for", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    rows = [calm(int(g), args.steps) for g in args.groups.split(",")]
    print(f"live recovery by replica groups (one process each), {args.steps}-step digits "
          "job, policy exact, no failures")
    print(f"  {'groups':>6}{'step (ms)':>11}{'DDP (ms)':>10}{'quorums':>9}"
          f"{'quorum share':>14}")
    for r in rows:
        print(f"  {r['groups']:>6}{r['step_s'] * 1e3:>11.2f}{r['ddp_step_s'] * 1e3:>10.2f}"
              f"{r['quorums']:>9}{r['quorum_share']:>13.1%}")
    result: dict = {"calm": rows}
    if args.kill_groups and args.kill_for > 0:
        base = next((r for r in rows if r["groups"] == args.kill_groups), None) \
            or calm(args.kill_groups, args.steps)
        k = with_kills(args.kill_groups, base["rate"], args.kill_every, args.kill_for,
                       args.seed)
        result["kills"] = k
        print(f"  {k['groups']} groups, a SIGKILL every {args.kill_every:g} s: {k['kills']} "
              f"kills in {k['run_s']:.0f} s, goodput {k['goodput']:.2f}, survivors' pause "
              f"{k['pause_s']:.2f} s (median; at most {k['max_pause_s']:.2f}), survivors "
              f"restarted {k['survivors_restarted']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
