"""Recovery and checkpoint-save figures, measured on this machine.

1. Recovery: one digits job on 2 data-parallel workers, with --kills SIGKILLs of a random
   worker at random steps (seeded), run each way with the same kills: today's restart
   (`shoal run --nproc-per-node 2 --max-restarts K`, a checkpoint every 50 steps), live exact and
   live available (`--replica-groups 2`), and once without kills (2-process DDP, the
   reference). Per mode: the survivors' pause per kill (to the other worker's next committed
   step past the killed worker's last one, or its first in a new process), the time until
   the replacement commits a step again, steps lost, restarts of workers that were not
   killed, bitwise equality with the reference (not for 'available'), goodput (committed
   steps per second against the same mode without kills), the mode's step rate without
   kills against DDP's, the bytes and time of each heal, and the run's length.
   A mode's figures without kills are medians of --pairs runs alternated with DDP's (the
   machine's speed drifts between runs).
   A live mode's run in which a worker that was not killed was restarted is kept (its
   steps and the job's output), and its folder named.
   `--json FILE` writes them, one object per mode. `--kills 0` measures only each mode's
   step rate without kills against DDP's (the cost of live recovery while nothing fails).
   `--config RUN.yaml` measures that cost on a `shoal train` config instead (40 steps a
   run unless --steps; its steps past the fifth), with each run's val_loss beside DDP's:
   under `exact` two groups of one process end with 2-process DDP's model. `--group-size N`:
   2 groups of N processes each, against DDP over 2 x N.
2. Save: a model + AdamW state of --state-mb megabytes (>= 500), saved by one process:
   synchronous save time, asynchronous save's blocking time (target <= 10 % of the
   synchronous time; after a first save that allocates the reused copy buffers) and total
   time, and save throughput against the disk's raw write
   speed measured in the same run with dd (conv=fdatasync), --repeats times, medians.

   With --compression (topk, powersgd, fp16, bf16) the job compresses its gradients so:
   under live exact, powersgd and topk hand their error feedback over every 10 steps or more
   seldom (``compression_state_share``), and a replacement redoes the steps since (its
   pause includes that redo).

    python benchmarks/recovery.py [--steps 14000] [--kills 6] [--seed 0] [--json FILE]
                                  [--compression none] [--no-save] [--state-mb 540]
                                  [--repeats 3] [--pairs 3]
    python benchmarks/recovery.py --config examples/gpt.yaml [--steps 40] [--pairs 3]
                                  [--compression none] [--group-size 1] [--json FILE]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

MODES = ("restart", "live exact", "live available")
CHECKPOINT_EVERY = 50  # today's restart: a checkpoint every 50 steps (about 0.4 s here)


def _publish(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: the other group reads it while it runs."""
    hidden = path.with_name(f".{path.name}")
    hidden.write_text(text)
    os.replace(hidden, path)


def job(out: Path, steps: int, schedule: list[tuple[int, int]], checkpoints: bool,
        compression: str = "none") -> None:
    """The training job of part 1 (this file with --job): 2 data-parallel workers (2
    processes, or 2 replica groups of 1). Each committed step is logged with its time and
    pid; kill i (step, victim) SIGKILLs the victim (rank, or replica group) in the forward
    pass after ``step``, once (a marker file remembers it), and not before kill i - 1's
    replacement is back."""
    import shoal
    from shoal.examples.digits import build_data, build_model

    shoal.init("gloo")
    slot = int(os.environ.get("SHOAL_FT_GROUP", shoal.rank()))
    model = build_model(hidden=256)
    settings = {"checkpoint_dir": str(out / "ckpt"), "checkpoint_every": CHECKPOINT_EVERY,
                "resume": "auto"} if checkpoints else {}
    trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            batch_size=32, progress=False, max_steps=steps,
                            metrics={"enabled": False}, compression=compression,
                            **settings)
    log = open(out / f"steps.{slot}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115
    first = out / f"first.{slot}.{os.getpid()}"

    def after_step(*_):
        if not first.exists():
            _publish(first, repr(time.time()))
        log.write(f"{time.time()!r} {trainer.global_step}\n")

    def back(i: int) -> bool:
        """Kill i's victim has a replacement that committed a step since."""
        killed = float((out / f"kill_{i}").read_text())
        return any(float(f.read_text()) > killed
                   for f in out.glob(f"first.{schedule[i][1]}.*"))

    def maybe_kill(*_):
        # Kill i comes at its step or, if the previous kill's replacement is not back yet,
        # as soon as it is: one worker is down at a time, as the figures assume.
        i = sum(1 for k in range(len(schedule)) if (out / f"kill_{k}").exists())
        if i == len(schedule) or (i > 0 and not back(i - 1)):
            return
        step, victim = schedule[i]
        if victim == slot and trainer.global_step >= step:
            _publish(out / f"kill_{i}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    trainer.optimizer.register_step_post_hook(after_step)
    model.register_forward_pre_hook(maybe_kill)
    trainer.fit(build_data()[0])
    if trainer.live is not None:
        (out / f"healed.{slot}.{os.getpid()}.json").write_text(json.dumps(trainer.live.healed))
        (out / f"quorums.{slot}.{os.getpid()}.json").write_text(json.dumps(
            {"quorums": trainer.live.quorums, "seconds": trainer.live.quorum_seconds}))
    if slot == 0 or trainer.live is not None:
        torch.save(trainer.module.state_dict(), out / f"final.{slot}.pt")


def _run_job(mode: str, steps: int, schedule: list[tuple[int, int]],
             compression: str = "none") -> Path:
    out = Path(tempfile.mkdtemp(prefix="shoal-recovery-"))
    flags = {"restart": ["--nproc-per-node", "2"],
             "live exact": ["--replica-groups", "2", "--ft-policy", "exact"],
             "live available": ["--replica-groups", "2", "--ft-policy", "available"],
             "baseline": ["--nproc-per-node", "2"]}[mode]
    cmd = [sys.executable, "-m", "shoal", "run", *flags, "--max-restarts", str(len(schedule)),
           __file__, "--job", str(out), "--steps", str(steps),
           "--schedule", json.dumps(schedule), "--compression", compression]
    if mode == "restart":
        cmd.append("--checkpoints")
    with open(out / "output.txt", "wb") as output:  # the job's lines, kept where odd
        subprocess.run(cmd, check=True, stdout=output, stderr=subprocess.STDOUT)
    return out


def _steps(out: Path) -> list[tuple[float, int, int, int]]:
    """Every committed step: (time, step, slot, pid), in time order."""
    rows = []
    for path in out.glob("steps.*"):
        _, slot, pid = path.name.split(".")
        for line in path.read_text().split("\n"):
            if line:
                t, step = line.split()
                rows.append((float(t), int(step), int(slot), int(pid)))
    return sorted(rows)


def _figures(mode: str, out: Path, schedule: list[tuple[int, int]], baseline: Path,
             calm_rate: float) -> dict:
    rows = _steps(out)
    pauses, rejoins, lost = [], [], 0
    done = [i for i in range(len(schedule)) if (out / f"kill_{i}").exists()]
    for i in done:
        victim = schedule[i][1]
        killed = float((out / f"kill_{i}").read_text())
        after = [(t, step, slot) for t, step, slot, _ in rows if t > killed]
        last = max(step for t, step, slot, _ in rows if t < killed and slot == victim)
        pid_at_kill = {slot: pid for t, _, slot, pid in rows if t < killed}
        # A survivor's pause ends with its first step past the victim's last one, or its
        # first step in a new process (restart); a step it was still finishing when the
        # victim died is not the end of a pause.
        pauses.append(next(t for t, step, slot, pid in rows if t > killed and slot != victim
                           and (step > last or pid != pid_at_kill[slot])) - killed)
        # None: the others finished before the replacement took part (policy available).
        rejoins.append(next((t for t, _, slot in after if slot == victim), None))
        if rejoins[-1] is not None:
            rejoins[-1] -= killed
        # Steps done again: those a worker had committed before the kill and commits again
        # after it (until the next kill). A survivor's step logged just after the victim's
        # death is not one: it was committed once.
        until = (float((out / f"kill_{i + 1}").read_text()) if i + 1 in done
                 else float("inf"))
        lost += max(len({step for t, step, s, _ in rows if t < killed and s == slot}
                        & {step for t, step, s, _ in rows if killed < t < until and s == slot})
                    for slot in {s for _, _, s, _ in rows})
    pids = {(slot, pid) for _, _, slot, pid in rows}
    restarts = len(pids) - len({slot for slot, _ in pids})
    healed = [h for path in out.glob("healed.*") for h in json.loads(path.read_text())
              if h["step"] > 0]  # step 0: the start's sync from group 0, not a recovery
    same = all(torch.equal(a, b) for a, b in zip(
        torch.load(out / "final.0.pt").values(),
        torch.load(baseline / "final.0.pt").values(), strict=True))
    back = [r for r in rejoins if r is not None]
    return {"mode": mode, "kills": len(done), "survivor_pause_s": statistics.median(pauses),
            "rejoin_s": statistics.median(back) if back else None, "steps_lost": lost,
            "survivor_restarts": restarts - len(done),
            "equal": same if mode != "live available" else None,
            "goodput": _rate(out) / calm_rate, "seconds": rows[-1][0] - rows[0][0],
            "healed_bytes": statistics.median([h["bytes"] for h in healed]) if healed else 0,
            "heal_s": statistics.median([h["seconds"] for h in healed]) if healed else None,
            "pauses_s": pauses, "rejoins_s": rejoins}


def _rate(out: Path) -> float:
    """Committed steps per second, first step to last."""
    rows = _steps(out)
    return len({step for _, step, _, _ in rows}) / (rows[-1][0] - rows[0][0])


def _alternated(mode: str, pairs: int, run: Callable[[str], Path],
                read: Callable[[Path], Any]) -> list[tuple[Any, Any]]:
    """``pairs`` runs of ``mode`` and of 2-process DDP ("baseline") without kills, each
    read by ``read``: (the mode's, DDP's) a pair. The pairs alternate which runs first
    (this machine's speed drifts between runs, and a run just after another starts on a
    busier machine)."""
    readings = []
    for pair in range(pairs):
        order = ("baseline", mode) if pair % 2 == 0 else (mode, "baseline")
        runs = {kind: run(kind) for kind in order}
        readings.append((read(runs[mode]), read(runs["baseline"])))
        for out in runs.values():
            shutil.rmtree(out, ignore_errors=True)
    return readings


def _calm(mode: str, steps: int, compression: str, pairs: int
          ) -> tuple[float, list[float]]:
    """(the mode's step rate without kills, the median of ``pairs`` runs; each run's rate
    against 2-process DDP's in the run beside it)."""
    readings = _alternated(mode, pairs, lambda kind: _run_job(kind, steps, [], compression),
                           _rate)
    return (statistics.median(rate for rate, _ in readings),
            [rate / ddp for rate, ddp in readings])


def _train(config: str, steps: int, mode: str, compression: str, group_size: int = 1
           ) -> Path:
    """One run of ``shoal train --config config`` for ``steps`` steps, as DDP over 2 x
    ``group_size`` processes ("baseline") or as 2 live groups of ``group_size``; its
    folder."""
    out = Path(tempfile.mkdtemp(prefix="shoal-recovery-"))
    live = ["--nproc-per-node", str(group_size), "--replica-groups", "2", "--ft-policy"]
    flags = {"baseline": ["--nproc-per-node", str(2 * group_size)],
             "live exact": [*live, "exact"],
             "live available": [*live, "available"]}[mode]
    cmd = [sys.executable, "-m", "shoal", "train", "--config", config, *flags,
           f"trainer.max_steps={steps}", f"run.dir={out / 'run'}",
           f"trainer.compression.name={compression}"]
    with open(out / "output.txt", "wb") as output:
        subprocess.run(cmd, check=True, stdout=output, stderr=subprocess.STDOUT)
    return out


def _train_figures(out: Path) -> tuple[float, float | None]:
    """A ``_train`` run's steps per second, by its mean step past the first 5 (those hold
    the start's quorum and the copy of group 0's weights), and its last val_loss."""
    lines = (out / "run" / "metrics.jsonl").read_text().split("\n")
    rows = [json.loads(line) for line in lines if line]
    steps = [r["step_time_s"] for r in rows if r.get("type") == "step" and r["step"] > 5]
    losses = [r["val_loss"] for r in rows if r.get("type") == "validation"]
    return 1 / statistics.mean(steps), losses[-1] if losses else None


def measure_config(config: str, steps: int, compression: str, pairs: int,
                   group_size: int = 1) -> list[dict]:
    """The cost of live recovery without failures on a `shoal train` config: each live
    policy's step rate (2 groups of ``group_size`` processes) against DDP's over as many
    processes, and whether its val_loss is DDP's."""
    results = []
    for mode in MODES[1:]:
        readings = _alternated(
            mode, pairs, lambda kind: _train(config, steps, kind, compression, group_size),
            _train_figures)
        ratios = [rate / ddp for (rate, _), (ddp, _) in readings]
        results.append({"mode": mode, "rate_vs_ddp": statistics.median(ratios),
                        "pairs_vs_ddp": ratios,
                        "val_loss": [loss for (_, loss), _ in readings],
                        "ddp_val_loss": [loss for _, (_, loss) in readings]})
    return results


def measure_recovery(steps: int, kills: int, seed: int, compression: str = "none",
                     pairs: int = 3) -> list[dict]:
    """The same job with the same kills, each way; each against itself without kills (its
    goodput) and against 2-process DDP without kills (its equality and step rate)."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(20, steps - 20), kills))
    schedule = [(step, rng.randrange(2)) for step in at]
    # The reference the kills' runs are compared with (--kills 0: none).
    baseline = _run_job("baseline", steps, [], compression) if schedule else None
    results, calm, vs_ddp = [], {}, {}
    for mode in MODES:
        # Without kills both live policies do the same (one calm run serves both), but under
        # powersgd and topk, where 'exact' also hands over and logs.
        shared = mode.startswith("live") and compression not in ("powersgd", "topk")
        kind = "live" if shared else mode
        if kind not in calm:
            calm[kind], vs_ddp[kind] = _calm(mode, steps, compression, pairs)
        # The mode's cost without failures: the median pair, and every pair's.
        costs = {"rate_vs_ddp": statistics.median(vs_ddp[kind]), "pairs_vs_ddp": vs_ddp[kind]}
        if not schedule:  # --kills 0: each mode's cost without failures, nothing else
            results.append({"mode": mode, **costs})
            continue
        assert baseline is not None  # (made when there are kills)
        out = _run_job(mode, steps, schedule, compression)
        figures = _figures(mode, out, schedule, baseline, calm[kind])
        figures.update(costs)
        results.append(figures)
        if mode != "restart" and figures["survivor_restarts"]:
            print(f"  {mode}: a worker that was not killed was restarted; the run's steps "
                  f"and output are kept in {out}", file=sys.stderr)
        else:
            shutil.rmtree(out, ignore_errors=True)
    if baseline is not None:
        shutil.rmtree(baseline, ignore_errors=True)
    return results


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


def _print_recovery(results: list[dict], steps: int, kills: int, compression: str,
                    config: str | None = None, group_size: int = 1) -> None:
    processes = 2 * group_size
    if config:
        print(f"the cost without failures of `shoal train --config {config}`, {steps} steps "
              f"(compression {compression}): 2 live groups of {group_size} "
              f"process{'es' if group_size > 1 else ''} against {processes}-process DDP, by "
              "the mean step past the first 5")
    else:
        print(f"recovery: a {steps}-step digits job on 2 data-parallel workers "
              f"(compression {compression}), {kills} SIGKILLs of a random worker at random "
              "steps, the same kills each way")
    for r in results:
        pairs = sorted(r["pairs_vs_ddp"])
        print(f"  {r['mode']}: without kills, {r['rate_vs_ddp']:.2f} x the step rate of "
              f"{processes}-process DDP (median of {len(pairs)} pairs; "
              f"{', '.join(f'{x:.2f}' for x in pairs)})")
        if "val_loss" in r:
            print(f"    val_loss {', '.join(map(repr, r['val_loss']))}; DDP's "
                  f"{', '.join(map(repr, r['ddp_val_loss']))}")
    if not kills or config:
        return
    print(f"  {'mode':<16}{'pause (s)':>10}{'rejoin (s)':>11}{'lost':>6}{'restarts':>9}"
          f"{'equal':>7}{'goodput':>9}{'healed':>10}{'heal (s)':>9}{'kills':>6}{'run (s)':>8}")
    for r in results:
        heal = f"{r['heal_s']:.2f}" if r["heal_s"] is not None else "-"
        rejoin = f"{r['rejoin_s']:.2f}" if r["rejoin_s"] is not None else "-"
        print(f"  {r['mode']:<16}{r['survivor_pause_s']:>10.2f}{rejoin:>11}"
              f"{r['steps_lost']:>6}{r['survivor_restarts']:>9}{str(r['equal']):>7}"
              f"{r['goodput']:>9.2f}{r['healed_bytes'] / 2**20:>8.2f}MB{heal:>9}{r['kills']:>6}"
              f"{r['seconds']:>8.0f}")
    print("  pause: kill -> the other worker's next step past the killed one's last, or its "
          "first in a new process (median); rejoin: kill -> "
          "the replacement's; lost: steps done again after a kill (live exact under powersgd "
          "or topk: the replacement's redo since the hand-over; the others lose none); "
          "restarts: of workers that were not killed; goodput: committed "
          "steps per second against the same mode without kills (targets: pause <= 1.5 s, "
          "0 steps lost, 0 restarts in live modes, goodput >= 0.85)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--steps", type=int, default=14000,
                        help="steps of the recovery job (default 14000: about 120 s here)")
    parser.add_argument("--seed", type=int, default=0, help="of the kills' steps and victims")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the recovery figures, one object per mode")
    parser.add_argument("--compression", default="none",
                        help="of the recovery job's gradients (none, fp16, bf16, powersgd, topk)")
    parser.add_argument("--no-save", action="store_true", help="skip part 2")
    parser.add_argument("--state-mb", type=int, default=540)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3,
                        help="alternated runs of DDP and of each mode without kills")
    parser.add_argument("--config", metavar="RUN.yaml",
                        help="instead of parts 1 and 2: each live policy's step rate without kills "
                        "on this `shoal train` config (--steps of it, default 40), against "
                        "2-process DDP's, --pairs alternated pairs; and each run's val_loss")
    parser.add_argument("--group-size", type=int, default=1,
                        help="with --config: processes in each of the 2 live groups (DDP "
                        "then runs on twice as many)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(Path(args.job), args.steps, [tuple(k) for k in json.loads(args.schedule)],
                   args.checkpoints, args.compression)
    if args.config:
        steps = args.steps if args.steps != parser.get_default("steps") else 40
        results = measure_config(args.config, steps, args.compression, args.pairs,
                                 args.group_size)
        _print_recovery(results, steps, 0, args.compression, args.config, args.group_size)
    else:
        results = measure_recovery(args.steps, args.kills, args.seed, args.compression,
                                   args.pairs)
        _print_recovery(results, args.steps, args.kills, args.compression)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.no_save or args.config:
        return None
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
