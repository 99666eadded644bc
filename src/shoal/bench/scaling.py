"""Scaling of a training job: the same run config at W = 1, 2, ... processes.

Each W trains ``steps`` steps with the per-process batch of the config (so the global batch
grows with W: weak scaling), with step metrics on. From the steps after ``warmup`` it takes
the throughput (samples/s over all ranks) and the share of the step spent waiting on
communication, and reports speedup (throughput over W=1's) and efficiency (speedup / W).
Writes scaling.json and scaling.png in the output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shoal.config.loader import save_run_config
from shoal.config.schema import RunConfig
from shoal.errors import LaunchError
from shoal.extras import install_line, installed
from shoal.launch import LaunchSpec, launch


def _job(config: RunConfig, world: int, steps: int, out: Path) -> RunConfig:
    job = config.model_copy(deep=True)
    job.run.dir = str(out / f"w{world}")
    job.run.nproc_per_node = world
    t = job.trainer
    t.epochs, t.max_steps, t.progress = None, steps, False
    t.checkpoint_dir = t.resume = None
    t.checkpoint_every = t.checkpoint_every_seconds = None
    t.metrics.enabled, t.metrics.dir, t.metrics.every = True, job.run.dir, steps
    return job


def _measure(run_dir: Path, warmup: int) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"][warmup:]
    if not steps:
        raise LaunchError(f"{run_dir}: no step after the {warmup} warm-up steps; "
                          "raise --steps")
    seconds = sum(r["step_time_s"] for r in steps)
    samples = sum(r["samples_per_s"] * r["step_time_s"] for r in steps)
    comm = sum(r["phases_s"]["comm"] for r in steps)
    return {"samples_per_s": samples / seconds, "step_time_s": seconds / len(steps),
            "comm_share": comm / seconds}


def run_scaling(config: RunConfig, max_nproc: int, steps: int, warmup: int,
                out: Path) -> list[dict]:
    rows = []
    for world in range(1, max_nproc + 1):
        job = _job(config, world, steps, out)
        path = save_run_config(job)
        code = launch(LaunchSpec(entry="shoal.launch.train_entry", module=True,
                                 args=["--config", str(path)], nproc_per_node=world))
        if code != 0:
            raise LaunchError(f"the run at {world} processes failed (exit code {code}); "
                              f"its files are in {job.run.dir}")
        assert job.run.dir is not None  # set by _job
        rows.append({"world_size": world, **_measure(Path(job.run.dir), warmup)})
    base = rows[0]["samples_per_s"]
    for row in rows:
        row["speedup"] = row["samples_per_s"] / base
        row["efficiency"] = row["speedup"] / row["world_size"]
    (out / "scaling.json").write_text(json.dumps(rows, indent=1))
    if installed("plot"):
        _chart(rows, out / "scaling.png")
    else:
        print(f"shoal: no scaling.png: the chart needs matplotlib ({install_line('plot')})",
              file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'W':>3} {'samples/s':>11} {'step ms':>9} {'speedup':>8} {'efficiency':>11} "
             f"{'comm share':>11}"]
    for r in rows:
        lines.append(f"{r['world_size']:>3} {r['samples_per_s']:>11,.0f} "
                     f"{r['step_time_s'] * 1e3:>9.2f} {r['speedup']:>7.2f}x "
                     f"{r['efficiency']:>10.0%} {r['comm_share']:>10.0%}")
    return "\n".join(lines)


def _chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    worlds = [r["world_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    left.plot(worlds, worlds, "--", color="grey", label="linear")
    left.plot(worlds, [r["speedup"] for r in rows], "o-", label="measured")
    left.set(xlabel="processes", ylabel="speedup", title="throughput speedup")
    left.legend()
    right.bar(worlds, [r["comm_share"] * 100 for r in rows])
    right.set(xlabel="processes", ylabel="% of step", title="waiting on communication")
    for axis in (left, right):
        axis.set_xticks(worlds)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
