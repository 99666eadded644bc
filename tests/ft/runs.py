"""Runs of tests/ft/live_job.py under `shoal run`, started beside each other and waited
for when first asked (4-process runs are slow: a run and the one it is compared with run
together)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from shoal.checkpoint import CheckpointStore
from shoal.checkpoint.layout import COMMIT
from tests import zygote
from tests.helpers import FORKED_FIRST, popen_shoal, states_equal

JOB = str(Path(__file__).with_name("live_job.py"))
TIMEOUT = 240
"""Seconds a run may take before the test fails: a hang guard (a run takes well under a
minute alone, a few on a loaded 2-core machine)."""


def replaced_once(group: int) -> list[str]:
    """``pids`` of a run of 2 groups of 1 whose group ``group`` was started again once (the
    other never)."""
    return sorted([*(f"pid.g{g}.a0.r0" for g in (0, 1)), f"pid.g{group}.a1.r0"])


REPLACED_ONCE = replaced_once(1)


class Runs:
    """`shoal run`s of the job, each started once and waited for when first asked."""

    def __init__(self, root: Path, steps: int):
        self.root, self.steps = root, steps
        self.started: dict[str, tuple[Path, subprocess.Popen]] = {}
        self.outputs: dict[str, str] = {}

    def start(self, name: str, *flags: str, job: str = "") -> None:
        """Start `shoal run FLAGS live_job.py OUT STEPS JOB` as ``name``, unless it is."""
        if name in self.started:
            return
        out = self.root / name
        out.mkdir()
        cmd = [sys.executable, "-m", "shoal", "run", "--hang-timeout", "0", *flags,
               JOB, str(out), str(self.steps), *job.split()]
        self.started[name] = out, start_piped(cmd)

    def wait(self, name: str) -> tuple[Path, str]:
        out, process = self.started[name]
        if name not in self.outputs:
            self.outputs[name] = process.communicate(timeout=TIMEOUT)[0].decode()
            assert process.returncode == 0, self.outputs[name][-4000:]
        return out, self.outputs[name]

    def __enter__(self) -> Runs:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for _, process in self.started.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def start_piped(cmd: list[str], cwd: Path | None = None) -> subprocess.Popen | zygote.Forked:
    """``cmd`` with its output (stderr too) in an unbuffered pipe: ``stdout.readline()``
    reads no further than the line, so that ``communicate`` then reads all the rest.
    A `python -m shoal` command is forked by the tests' zygote where there is one. ``cwd``:
    where it runs (default: here)."""
    where = str(cwd or os.getcwd())
    if cmd[1:3] == ["-m", "shoal"]:
        return popen_shoal(*cmd[3:], cwd=where, stderr_to_stdout=True, env=FORKED_FIRST)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=where)


def final(out: Path, group: int = 0, rank: int = 0) -> dict:
    """What rank ``rank`` of group ``group`` saved at the end (model, optimizer, step), on
    the CPU."""
    return torch.load(out / f"final.g{group}.r{rank}.pt", map_location="cpu")


def figures(out: Path, group: int = 0, rank: int = 0) -> dict:
    """What rank ``rank`` of group ``group`` reported at the end (validation, quorums)."""
    return json.loads((out / f"figures.g{group}.r{rank}.json").read_text())


def pids(out: Path) -> list[str]:
    """The workers a run started: pid.g<group>.a<attempt>.r<rank>, sorted."""
    return sorted(p.name for p in out.glob("pid.*"))


def written_before_the_kill(out: Path, kill: str, steps: int) -> list[bool]:
    """For the checkpoints of steps 1 to ``steps`` of a run's ``--checkpoints OUT/ckpt``:
    whether each was last written before ``--kill KILL`` (its marker's time; on a coarse
    clock a checkpoint written just before it shows the same time)."""
    store = CheckpointStore(out / "ckpt")
    killed = (out / f"killed.{kill}").stat().st_mtime
    return [(store.path_for(step) / COMMIT).stat().st_mtime <= killed
            for step in range(1, steps + 1)]


def step_metrics(folder: Path) -> list[tuple[int, float, float, float | None]]:
    """(step, loss, samples, grad_norm) of each step in ``folder``'s metrics.jsonl, as its
    reader takes them: a start or resume marked at step s drops what was written of the
    steps after s (they are done again)."""
    steps: dict[int, tuple[int, float, float, float | None]] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") in ("start", "resume"):
            steps = {s: row for s, row in steps.items() if s <= r["step"]}
        elif r["type"] == "step":
            assert r["step"] not in steps, f"step {r['step']} written twice"
            steps[r["step"]] = (r["step"], r["loss"],
                                round(r["samples_per_s"] * r["step_time_s"]), r["grad_norm"])
    return sorted(steps.values())


def same_end(ours: dict, theirs: dict) -> bool:
    """Two ``final`` saves are bitwise equal: step, model and optimizer."""
    return (ours["step"] == theirs["step"] and states_equal(ours["model"], theirs["model"])
            and states_equal(ours["optimizer"], theirs["optimizer"]))
