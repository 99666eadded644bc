"""The Trainer's step metrics: recorded on every rank, gathered every few steps, written once.

Each rank keeps a few floats per step (phases, loss, samples, bytes). At every ``every``-th
step one all-gather brings them and each rank's resource use to rank 0, which writes a JSON line
per step and one per window (every rank's figures and the straggler, if any), mirrors the
main figures to its trackers (TensorBoard, MLflow, W&B, a user's own: see
``shoal.metrics.trackers``), and prints the straggler when it changes. At the end of the
run rank 0 prints a table: every rank's mean step split, CPU and memory.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shoal.extras import require
from shoal.imports import Named
from shoal.metrics import trackers as tracking_
from shoal.metrics.flops import peak_flops
from shoal.metrics.mlflow import MLflowConfig, status_of
from shoal.metrics.resources import FIELDS as RESOURCE_FIELDS
from shoal.metrics.resources import ResourceSampler, memory_limit
from shoal.metrics.steps import PHASES, StepClock
from shoal.metrics.stragglers import describe, find_straggler
from shoal.metrics.tracker import Tracker
from shoal.metrics.unwritten import StepFigures
from shoal.metrics.wandb import WandbConfig
from shoal.metrics.writer import MetricsWriter
from shoal.runtime.collectives import gather_into_tensor
from shoal.runtime.restarts import restart_cause

STEP_FIELDS = (*PHASES, "step", "samples", "tokens", "bytes")
TENSOR_FIELDS = ("loss", "grad_norm")  # device tensors, read once per window
SUMMARY = "summary.txt"  # the end-of-run table, as a tracker's file


class MetricsConfig(BaseModel):
    """Settings of the Trainer's step metrics (the ``trainer.metrics`` section)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = True
    """Measure every step's phases on every rank (a few clock reads per step)."""
    every: int = Field(50, ge=1)
    """Gather every rank's figures, look for a straggler and write them at every step that
    is a multiple of this (and at the end)."""
    grad_norm_every: int | None = Field(10, ge=1)
    """Measure the gradient norm every this many steps: a pass over every gradient, a few
    percent of a small model's step. Steps that clip or check for non-finite gradients
    measure it anyway and record it for free. None: only those steps."""
    resources: bool = True
    """Sample CPU %, resident memory and, on CUDA with nvidia-ml-py, GPU use per rank."""
    resource_interval: float = Field(1.0, gt=0)
    """Seconds between resource samples (a background thread per rank)."""
    dir: str | None = None
    """Where rank 0 writes metrics.jsonl and tensorboard/ (shoal train: the run directory);
    unset: no files, the console summary only."""
    tensorboard: bool | None = None
    """Also write TensorBoard event files. None: when the tensorboard package is installed
    (``shoal[tensorboard]``); true: always, and a run without the package is refused before
    it starts; false: never."""

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, value: bool | None) -> bool | None:
        if value:
            require("tensorboard", "trainer.metrics.tensorboard: true")
        return value
    straggler_threshold: float = Field(0.2, gt=0)
    """A rank is named a straggler when its busy time per step exceeds the median rank's by
    more than this fraction of the median step time."""
    peak_flops: float | None = Field(None, gt=0)
    """Peak FLOP/s of one device in the training precision, for the model FLOPs utilization
    (MFU) of models that say their FLOPs per token; default: from shoal's table of known
    GPUs (dense tensor-core bf16/fp16, or fp32), none on a CPU."""
    mlflow: MLflowConfig | None = None
    """Also log to an MLflow run from rank 0: params, the figures of every step, the
    end-of-run table and the final metrics (see MLflowConfig); true: MLflow's defaults."""

    wandb: WandbConfig | None = None
    """Also log to a Weights & Biases run from rank 0: the run config, the figures of every
    step, the end-of-run table and the final metrics (see WandbConfig); true: W&B's
    defaults."""
    trackers: list[Named] = Field(default_factory=list)
    """Your own trackers by import path ('module:MyTracker', searched beside the run config
    as builders are) or as ``{builder, args}``: each a ``shoal.Tracker``."""

    @field_validator("mlflow", "wandb", mode="before")
    @classmethod
    def _switch(cls, value: object) -> object:
        return {} if value is True else None if value is False else value

    def untracked(self) -> MetricsConfig:
        """These settings without trackers (a live group that takes over the writing: the
        first writer's tracker runs stay open, for it to continue)."""
        return self.model_copy(update={"mlflow": None, "wandb": None, "trackers": []})

    def wants_grad_norm(self, global_step: int) -> bool:
        """Whether step ``global_step`` measures the gradient norm."""
        every = self.grad_norm_every
        return every is not None and global_step % every == 0

    @model_validator(mode="after")
    def _trackers_need_metrics(self) -> MetricsConfig:
        for name in ("mlflow", "wandb"):
            if getattr(self, name) is not None and not self.enabled:
                raise ValueError(f"{name} logs the step metrics, which enabled: false turns "
                                 f"off (set enabled: true, or unset {name})")
        return self


class StepMetrics:
    """Per-step phases of this rank; gathered to rank 0 at every ``config.every``-th step
    (the windows end at the same steps in every run and every live group)."""

    def __init__(self, config: MetricsConfig, device: torch.device, rank: int, world: int,
                 flops_per_token: float | None = None, precision: str = "32",
                 extras: tuple[str, ...] = (), labels: dict[str, str] | None = None,
                 start_step: int = 0, resumed: bool = False, params: dict | None = None,
                 tracking: dict[str, str] | None = None, announce: bool = True,
                 trackers: list[Tracker] = ()):  # type: ignore[assignment]
        """``extras``: the names of further figures each ``step`` gives (the same on every
        rank, or averaged over them); ``labels``: names the phases go by in what is
        printed (reinforcement learning's 'data' is its rollout); ``start_step`` and
        ``resumed``: where this start of the job begins, marked in metrics.jsonl;
        ``params``: the settings a tracker logs as the run's config; ``tracking``: the
        trackers' run ids a resumed checkpoint kept (continued), updated with the runs
        opened (to be kept in the next checkpoints); ``announce``: mark the start now (else
        ``started`` does, once the step it starts from is known: a live replacement's);
        ``trackers``: trackers given in code, beside those ``config`` names."""
        self.config = config
        self.fields = (*STEP_FIELDS, *extras)
        self.extras = extras
        self.labels = labels or {}
        self.device = device
        self.rank, self.world = rank, world
        # MFU: the model's FLOPs for the tokens of a step over what the job's devices could
        # do in that time; only when both the model's FLOPs and the device's peak are known.
        peak = config.peak_flops or peak_flops(device, precision)
        self.flops_per_token = flops_per_token if peak else None
        self.peak_flops = peak
        self.clock = StepClock(device)
        self.sampler = ResourceSampler(device, config.resource_interval).start() \
            if config.resources else None
        self.writer = MetricsWriter(config.dir) if config.dir and rank == 0 else None
        self.trackers = tracking_.build(config, trackers) if rank == 0 else []
        tracking_.start_all(self.trackers, params or {}, config.dir,
                            tracking if tracking is not None else {})
        self._steps: list[tuple[int, int, float, dict[str, float]]] = []  # step, epoch, lr
        self._losses: list[torch.Tensor] = []  # device tensors: read once per window
        self._norms: list[torch.Tensor | None] = []
        self.totals: list[dict[str, float]] | None = None  # rank 0: per-rank sums
        self.total_steps = 0
        self.total_tokens = self.total_time = 0.0  # rank 0: the job's tokens and step time
        self._last_straggler: tuple[int, str] | None = None
        self.last_step = start_step
        """The last step recorded (written, or in the window under way)."""
        self._resumed = resumed
        self.announced = False
        """The start is marked (``started``)."""
        if announce:
            self.started(start_step)

    def started(self, step: int) -> None:
        """Mark the start (and each restart or resume) at ``step``, for the dashboard's
        curves (it forgets what was recorded after it: those steps are done again); a
        restart under `shoal run` after the failure the launcher told of. Once."""
        if self.announced:
            return
        self.announced = True
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        failure = restart_cause(restart)
        if failure is not None:
            self.record("event", step, kind="failure", attempt=failure.attempt,
                        rank=failure.rank, pid=failure.pid, cause=failure.cause,
                        exit_code=failure.exit_code, failed_at=failure.time)
        self.record("event", step, kind="resume" if self._resumed else "start",
                    world_size=self.world, restart=restart, memory_limit_bytes=memory_limit())

    def record(self, type_: str, step: int, /, **fields) -> None:
        """A line of type ``type_`` at ``step`` in metrics.jsonl (rank 0; others: no-op),
        e.g. validation results, or an event: start, resume, end. Validation figures go to
        the trackers too."""
        if self.writer is not None:
            self.writer.write({"type": type_, "step": step, "time": time.time(), **fields})
        if type_ == "validation":
            values = tracking_.finite({k: v for k, v in fields.items() if k != "epoch"})
            for tracker in self.trackers:
                tracker.log_metrics(step, values)

    def step(self, global_step: int, epoch: int, lr: float, loss: torch.Tensor,
             grad_norm: torch.Tensor | None, samples: int, tokens: int, comm,
             extras: dict[str, float] | None = None) -> None:
        """Close this step (its clock marks are done); flush when the window is full."""
        self.clock.end_step(comm.wait, comm.blocked)
        counts = {"samples": float(samples), "tokens": float(tokens), "bytes": comm.bytes,
                  **{name: float((extras or {}).get(name, float("nan")))
                     for name in self.extras}}
        self._keep(global_step, epoch, lr, counts, loss.detach(),
                   grad_norm.detach() if grad_norm is not None else None)

    def _keep(self, global_step: int, epoch: int, lr: float, counts: dict[str, float],
              loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self._steps.append((global_step, epoch, lr, counts))
        self._losses.append(loss)
        self._norms.append(grad_norm)
        self.last_step = global_step
        if global_step % self.config.every == 0:
            self.flush()

    def adopt(self, steps: list[tuple]) -> int | None:
        """A live group that becomes the writer (or heals): record ``steps``
        (``StepFigures``, as a group kept them), those after what this run has recorded
        (its file says how far the writer before wrote), each with the wall time that group
        measured and no split of it. Returns the step before the first one recorded (None:
        none was). Collective, as ``step``: every rank takes the steps rank 0's file says."""
        in_file = torch.tensor([self.writer.last_step() if self.writer else 0],
                               device=self.device)
        if self.world > 1:
            torch.distributed.broadcast(in_file, 0)
        written = max(self.last_step, int(in_file.item()))
        taken = [f for f in map(StepFigures._make, steps) if f.step > written]
        for f in taken:
            self.clock.unmeasured(f.seconds)
            counts = {"samples": float(f.samples), "tokens": float(f.tokens),
                      "bytes": f.bytes, **dict.fromkeys(self.extras, float("nan"))}
            self._keep(f.step, f.epoch, f.lr, counts, f.loss.to(self.device),
                       f.grad_norm.to(self.device) if f.grad_norm is not None else None)
        return taken[0].step - 1 if taken else None

    def sync(self) -> None:
        """Collective, before a checkpoint: the steps so far written, and sent to the
        trackers, so that every step the checkpoint holds is logged when it is committed."""
        self.flush()
        for tracker in self.trackers:
            tracker.wait()

    def flush(self) -> None:
        """Collective: every rank calls it at the same step."""
        if not self._steps:
            return
        phases = self.clock.take()
        own = torch.tensor([[{**p, **c}[f] for f in self.fields]
                            for p, (*_, c) in zip(phases, self._steps, strict=True)],
                           dtype=torch.float64)
        nan = torch.full((), float("nan"), device=self._losses[0].device)
        # (float64: a live step's loss is already the mean over its groups, DDP's figure)
        read = torch.stack([torch.stack([loss.double().reshape(()) for loss in self._losses]),
                            torch.stack([(n if n is not None else nan).double().reshape(())
                                         for n in self._norms])], dim=1)
        own = torch.cat([own, read.cpu()], dim=1)
        resources = self.sampler.take() if self.sampler else dict.fromkeys(
            RESOURCE_FIELDS, float("nan"))
        flat = torch.cat([own.reshape(-1), torch.tensor(
            [resources[f] for f in RESOURCE_FIELDS], dtype=torch.float64)]).to(self.device)
        if self.world > 1:
            gathered = torch.empty(self.world * flat.numel(), dtype=flat.dtype,
                                   device=self.device)
            gather_into_tensor(gathered, flat)
            flat = gathered
        if self.rank == 0:
            self._report(flat.cpu().view(self.world, -1))
        self._steps, self._losses, self._norms = [], [], []

    def _report(self, table: torch.Tensor) -> None:
        n = len(self._steps)
        fields = [*self.fields, *TENSOR_FIELDS]
        per_step = table[:, :n * len(fields)].view(self.world, n, len(fields))
        resources = table[:, n * len(fields):]
        column = {f: per_step[:, :, i] for i, f in enumerate(fields)}
        # Over the steps this run measured (``adopt``'s have no split: NaN phases).
        measured = ~column["data"][0].isnan()
        ranks = []
        for r in range(self.world):
            row = {f: column[f][r][measured].mean().item() for f in (*PHASES, "step")}
            row.update({f: resources[r, i].item() for i, f in enumerate(RESOURCE_FIELDS)})
            ranks.append(row)
        self._accumulate(column, resources, measured)
        first, last = self._steps[0][0], self._steps[-1][0]
        straggler = find_straggler(ranks, self.config.straggler_threshold) \
            if measured.any() else None
        if straggler and (straggler["rank"], straggler["phase"]) != self._last_straggler:
            print(f"shoal: {describe(straggler, first, last, self.labels)}", file=sys.stderr,
                  flush=True)
        self._last_straggler = (straggler["rank"], straggler["phase"]) if straggler else None
        if self.writer is None and not self.trackers:
            return
        now = time.time()
        for i, (global_step, epoch, lr, _) in enumerate(self._steps):
            step_time = column["step"][:, i].max().item()
            record: dict[str, Any]
            record = {"type": "step", "step": global_step, "epoch": epoch, "time": now,
                      "loss": column["loss"][:, i].mean().item(), "lr": lr,
                      "grad_norm": column["grad_norm"][:, i].mean().item(),
                      "step_time_s": step_time,
                      "samples_per_s": column["samples"][:, i].sum().item() / step_time,
                      "phases_s": {p: column[p][:, i].mean().item() for p in PHASES},
                      "comm_bytes": column["bytes"][0, i].item(),
                      "rank_step_s": column["step"][:, i].tolist(),
                      "rank_comm_s": column["comm"][:, i].tolist()}
            for name in self.extras:  # NaN where no rank had a value
                values = column[name][:, i]
                record[name] = values.nanmean().item() if values.isfinite().any() else None
            tokens = column["tokens"][:, i].sum().item()
            if tokens:
                record["tokens_per_s"] = tokens / step_time
                if self.flops_per_token:
                    record["mfu"] = self.mfu(record["tokens_per_s"])
            if self.writer is not None:
                self.writer.write(record)
            self._scalars(global_step, {
                "train/loss": record["loss"], "train/lr": lr,
                "train/grad_norm": record["grad_norm"],
                "train/samples_per_s": record["samples_per_s"],
                "train/tokens_per_s": record.get("tokens_per_s"),
                "train/mfu": record.get("mfu"),
                "time/step_s": step_time, "comm/bytes": record["comm_bytes"],
                **{f"train/{name}": record[name] for name in self.extras},
                **{f"time/{p}_s": v for p, v in record["phases_s"].items()}})
        if self.writer is not None:
            self.writer.write({"type": "ranks", "steps": [first, last], "time": now,
                               "ranks": [{"rank": r, **row} for r, row in enumerate(ranks)],
                               "straggler": straggler})
        self._scalars(last, {f"rank{r}/{k}": v for r, row in enumerate(ranks)
                             for k, v in row.items() if k != "step"})
        for tracker in self.trackers:
            tracker.flush()  # the window at once

    def _scalars(self, step: int, values: dict[str, float | None]) -> None:
        """The main figures, to every tracker under the same names."""
        figures = tracking_.finite(values)
        for tracker in self.trackers:
            tracker.log_metrics(step, figures)

    def _accumulate(self, column: dict[str, torch.Tensor], resources: torch.Tensor,
                    measured: torch.Tensor) -> None:
        if self.totals is None:
            self.totals = [dict.fromkeys((*PHASES, "step", *RESOURCE_FIELDS), 0.0)
                           for _ in range(self.world)]
        n = int(measured.sum())
        for r, totals in enumerate(self.totals):
            for p in (*PHASES, "step"):
                totals[p] += column[p][r][measured].sum().item()
            for i, f in enumerate(RESOURCE_FIELDS):  # weighted by steps, for a run mean
                totals[f] += resources[r, i].item() * n
        self.total_steps += n
        self.total_tokens += column["tokens"].sum().item()
        self.total_time += column["step"].max(dim=0).values.sum().item()

    def mfu(self, tokens_per_s: float) -> float:
        """Model FLOPs utilization of the whole job at this token rate (0..1)."""
        # Called only when flops_per_token is set, which it is only with a peak.
        assert self.flops_per_token is not None and self.peak_flops is not None
        return tokens_per_s * self.flops_per_token / (self.peak_flops * self.world)

    def finish(self, show_summary: bool = True, result: dict | None = None) -> None:
        """Collective, at the end of training: the last window, then rank 0's table (and
        in each tracker the table and ``result``, the run's final metrics, as
        metrics.json)."""
        self.flush()
        if self.rank != 0:
            return
        if self.totals and self.total_steps:
            lines = [summary_table(self.totals, self.total_steps, self.labels)]
            if self.total_tokens and self.total_time:
                rate = self.total_tokens / self.total_time
                mfu = f", MFU {self.mfu(rate):.1%}" if self.flops_per_token else ""
                lines.append(f"shoal: {rate:,.0f} tokens/s{mfu}")
            if show_summary:
                print("\n".join(lines), flush=True)
            for tracker in self.trackers:
                tracker.log_text("\n".join(lines) + "\n", SUMMARY)
        if result is not None:
            for tracker in self.trackers:
                tracker.log_dict(result, "metrics.json")

    def close(self) -> None:
        """Not collective (also on the way out of an error): stop sampling, close files,
        end the trackers' runs (FINISHED; KILLED on the way out of an exit or interrupt;
        FAILED out of an error)."""
        if self.sampler:
            self.sampler.stop()
        if self.writer is not None:
            self.writer.close()
        status = status_of(sys.exc_info()[1])
        for tracker in self.trackers:
            tracker.finish(status)
        self.trackers = []


def summary_table(totals: list[dict[str, float]], steps: int,
                  labels: dict[str, str] | None = None) -> str:
    """Every rank's mean step split (ms), CPU % and memory over ``steps`` steps."""
    names = {"optimizer": "optim", **(labels or {})}
    header = (f"{'rank':>4} {'step':>8} " + " ".join(f"{names.get(p, p):>8}" for p in PHASES)
              + f" {'cpu %':>7} {'rss MB':>8}")
    lines = [f"shoal: time per step by rank over {steps} steps (ms)", header]
    for rank, t in enumerate(totals):
        ms = [t[p] / steps * 1e3 for p in ("step", *PHASES)]
        cpu, rss = t["cpu_percent"] / steps, t["rss_bytes"] / steps / 2**20
        gpu = ""
        if t["gpu_util_percent"] == t["gpu_util_percent"]:  # not NaN: NVML is there
            gpu = (f"  gpu {t['gpu_util_percent'] / steps:.0f} %, "
                   f"{t['gpu_memory_bytes'] / steps / 2**20:.0f} MB")
        lines.append(f"{rank:>4} " + " ".join(f"{v:>8.2f}" for v in ms)
                     + f" {cpu:>7.0f} {rss:>8.0f}{gpu}")
    return "\n".join(lines)
