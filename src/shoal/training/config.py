"""TrainerConfig: every Trainer setting, validated once."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from shoal.checkpoint import layout
from shoal.errors import usage_error
from shoal.ft.config import FaultToleranceConfig
from shoal.imports import Named
from shoal.metrics.recorder import MetricsConfig
from shoal.parallel.averaging import DiLoCoConfig, LocalSGDConfig
from shoal.parallel.compression import CompressionConfig
from shoal.parallel.ddp import DDPConfig
from shoal.parallel.fsdp import FSDPConfig
from shoal.parallel.pipeline_parallel import PipelineConfig
from shoal.parallel.tensor_parallel import TensorParallelConfig
from shoal.parallel.topology import ParallelDims

Precision = Literal["32", "bf16-mixed", "fp16-mixed"]

def parse_window(value: object) -> tuple[int, int] | None:
    """``'20-25'``, ``[20, 25]`` or a single step ``20`` as (first, last).

    Raises:
        ValueError: If it is none of those, or first is under 1 or after last.
    """
    if value is None:
        return None
    if isinstance(value, int):
        first = last = value
    elif isinstance(value, str) and value.replace("-", "", 1).isdigit():
        head, _, rest = value.partition("-")
        first, last = int(head), int(rest or head)
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        first, last = int(value[0]), int(value[1])
    else:
        raise ValueError(f"{value!r}: give the steps as FIRST-LAST, e.g. 20-25")
    if not 1 <= first <= last:
        raise ValueError(f"{value!r}: the first step must be at least 1 and not after the "
                         "last")
    return first, last


class TrainerConfig(BaseModel):
    """Settings of ``shoal.Trainer`` and the ``trainer:`` section of a run config.

    Raises:
        pydantic.ValidationError: If a setting is unknown or invalid, or settings conflict
            (e.g. a compression with a strategy other than 'ddp'); ``TrainerConfig.build``
            raises a one-line UsageError naming the key instead.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    strategy: Literal["ddp", "zero1", "zero2", "fsdp", "local_sgd", "diloco"] = "ddp"
    """How the model is spread over processes: 'ddp' replicates it and all-reduces
    gradients every step; 'zero1' does the same with the optimizer state sharded over the
    ranks; 'zero2' shards gradients and optimizer state too, 'fsdp' (ZeRO-3) also the
    parameters (both FSDP2); 'local_sgd' and 'diloco' let each rank train its own replica
    and average the weights every few steps."""
    parallel: ParallelDims = Field(default_factory=ParallelDims)
    """Degrees of data (dp), tensor (tp) and pipeline (pp) parallelism; dp x tp x pp must
    be the world size (dp defaults to what tp and pp leave). With tp or pp > 1 the
    strategy says how the dp ranks share each (stage of the) split model: 'ddp'
    (replicas), 'zero2' or 'fsdp' (shards)."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Options of the ready transformer plan, used when parallel.tp > 1."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Schedule and microbatches, used when parallel.pp > 1."""
    ddp: DDPConfig = Field(default_factory=DDPConfig)
    """Settings of DistributedDataParallel, under 'ddp' and 'zero1'."""
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    """Settings of the sharded strategies 'zero2' and 'fsdp' (CPU offload, bf16 compute)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them (any
    strategy): less memory for about one more forward pass."""
    compile: bool = False
    """torch.compile the model: whole, after DDP wraps it (ddp, zero1, local_sgd, diloco),
    or block by block before FSDP shards it (zero2, fsdp, tp, pp). The first steps take
    longer while it compiles."""
    blocks: list[str] | None = None
    """Class names of the model's repeated blocks, the units of FSDP sharding and of
    activation checkpointing (e.g. ['Block']). Default: the children of the model's
    ``blocks`` ModuleList; else a transformers model's layers (its ``_no_split_modules``
    classes); else the children of its longest ModuleList of one class."""
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    """How 'ddp' sends gradients: none, fp16, bf16, powersgd or topk (see CompressionConfig)."""
    local_sgd: LocalSGDConfig = Field(default_factory=LocalSGDConfig)
    """Settings of the 'local_sgd' strategy."""
    diloco: DiLoCoConfig = Field(default_factory=DiLoCoConfig)
    """Settings of the 'diloco' strategy."""
    precision: Precision = "32"
    """'32' (full), 'bf16-mixed' (bf16 autocast), 'fp16-mixed' (fp16 autocast + grad scaler)."""
    batch_size: int = Field(32, gt=0)
    """Samples per data-parallel rank per micro-batch; the global batch is batch_size x dp x
    K (dp: the world size unless tensor or pipeline parallelism split the model)."""
    accumulate_grad_batches: int = Field(1, gt=0)
    """K: micro-batches per optimizer step; gradients are all-reduced only on the last."""
    clip_grad_norm: float | None = Field(None, gt=0)
    """Clip the global gradient norm to this value before each optimizer step."""
    epochs: int | None = Field(None, gt=0)
    """Passes over the training data (default 1 when max_steps is not set either)."""
    max_steps: int | None = Field(None, gt=0)
    """Stop after this many optimizer steps."""
    val_every_steps: int | None = Field(None, gt=0)
    """Also validate every this many optimizer steps (besides each epoch's end), where
    ``fit`` is given validation data."""
    callbacks: list[Named] = Field(default_factory=list)
    """Callbacks by import path ('module:Class', searched beside the run config as builders
    are) or as ``{builder, args}``; a Trainer built in code takes objects too (see
    shoal.Callback)."""
    profile_steps: tuple[int, int] | None = None
    """Profile these steps on every rank with torch.profiler, given as FIRST-LAST ('20-25')
    or one step: a Chrome trace per rank (``rank<r>.pt.trace.json``) in ``profile_dir``."""
    profile_dir: str | None = None
    """Where the profiler's traces go; default: the metrics directory's profile/ (shoal
    train: the run directory's), else ./profile."""

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _window(cls, value: object) -> object:
        return parse_window(value)

    seed: int = 0
    """Seed of the data order (same on every rank) and of each rank's RNGs (seed + rank)."""
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes per rank, for datasets the Trainer wraps."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""
    backend: Literal["gloo", "nccl"] | None = None
    """Process-group backend; default NCCL with CUDA, else gloo."""
    nonfinite: Literal["skip", "stop"] | None = None
    """On a NaN/Inf gradient: 'skip' the step on all ranks, 'stop' with an error naming the
    step and the ranks whose loss was not finite; unset: no check (no cost)."""
    checkpoint_dir: str | None = None
    """Directory of checkpoints (shared by all ranks); none are written when unset."""
    checkpoint_every: int | None = Field(None, gt=0)
    """Save every this many optimizer steps (and at the end of fit)."""
    checkpoint_every_seconds: float | None = Field(None, gt=0)
    """Also save when this many seconds passed since the last save (rank 0's clock)."""
    keep_last: int = Field(3, gt=0)
    """How many complete checkpoints to keep."""
    async_checkpoint: bool = False
    """Write checkpoints in the background: a step waits only for the copy of the state."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Step metrics: phase split per rank, resources, stragglers, JSONL and TensorBoard."""
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    """How the job lives through a failed worker: 'restart' (every worker, from the last
    checkpoint) or 'live' (replica groups; only the failed one restarts and heals from a
    live one). See docs/fault_tolerance.md."""
    resume: str | None = None
    """'auto': continue from the newest complete checkpoint in checkpoint_dir, if any;
    a path: from that checkpoint (refused at once when it holds no complete checkpoint;
    new checkpoints go to checkpoint_dir, none when it is unset); unset: start afresh."""
    init_from: str | None = None
    """Start a new run from these weights (weights only: a new optimizer, step 0): a
    .safetensors or torch file of the model's state_dict (``shoal export``), a Hugging Face
    model directory, or a shoal checkpoint. A resume (``resume``) that finds a checkpoint
    goes on from it instead."""

    @field_validator("init_from")
    @classmethod
    def _weights_there(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).exists():
            raise ValueError(f"{value}: no such file or directory")
        return value

    @model_validator(mode="after")
    def _strategy_settings(self) -> TrainerConfig:
        name = self.compression.name
        if name != "none" and self.strategy != "ddp":
            raise ValueError(f"compression '{name}' compresses the gradient all-reduce of "
                             f"strategy 'ddp'; strategy '{self.strategy}' does not use it "
                             "(use strategy 'ddp', or compression 'none')")
        local = self.strategy in ("local_sgd", "diloco")
        if self.nonfinite is not None and local:
            raise ValueError(f"nonfinite needs the same gradients on every rank; with "
                             f"strategy '{self.strategy}' each rank has its own (unset it)")
        if self.parallel.model_parallel and (name != "none" or self.ddp != DDPConfig()):
            raise ValueError("compression and the ddp settings apply to "
                             "DistributedDataParallel, which a model split by tensor or "
                             "pipeline parallelism does not use: unset them, or set tp and "
                             "pp to 1")
        if self.parallel.model_parallel and self.precision == "fp16-mixed":
            # torch's scalers cannot unscale a mix of DTensor and plain gradients, and the
            # pipeline schedule runs backward without the scaler's loss scaling.
            raise ValueError("precision 'fp16-mixed' cannot be combined with tensor or "
                             "pipeline parallelism: use 'bf16-mixed' (no gradient scaler)")
        if self.strategy in ("zero1", "local_sgd", "diloco") and self.parallel.model_parallel:
            raise ValueError(f"strategy '{self.strategy}' cannot be combined with tensor or "
                             "pipeline parallelism (set tp and pp to 1, or use strategy "
                             "'ddp', 'zero2' or 'fsdp')")
        return self

    @model_validator(mode="after")
    def _pipeline_settings(self) -> TrainerConfig:
        pp, micro = self.parallel.pp, self.pipeline.microbatches
        if pp == 1:
            return self
        if self.batch_size % micro:
            raise ValueError(f"pipeline.microbatches {micro} must divide batch_size "
                             f"{self.batch_size}: each batch is cut into equal microbatches")
        if self.pipeline.schedule == "1f1b" and micro < pp:
            raise ValueError(f"pipeline schedule '1f1b' needs microbatches >= stages: got "
                             f"{micro} for pp {pp}; raise pipeline.microbatches to {pp} or "
                             "use schedule 'gpipe'")
        return self

    @model_validator(mode="after")
    def _checkpoint_settings(self) -> TrainerConfig:
        if (self.checkpoint_every or self.checkpoint_every_seconds or self.resume == "auto"
                ) and not self.checkpoint_dir:
            raise ValueError("checkpoint_every(_seconds) and resume='auto' need "
                             "checkpoint_dir")
        return self

    @model_validator(mode="after")
    def _resume_path(self) -> TrainerConfig:
        # A run asked to continue must not quietly start afresh: the path must hold a
        # complete checkpoint now, before any process starts.
        if self.resume not in (None, "auto"):
            problem = layout.problem(Path(self.resume))
            if problem is not None:
                raise ValueError(f"resume {self.resume}: {problem}")
        return self

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_as_text(cls, value: object) -> object:
        return str(value) if isinstance(value, int) else value

    @classmethod
    def build(cls, **settings: object) -> TrainerConfig:
        """Validate keyword settings; a bad one raises a UsageError naming it."""
        try:
            return cls(**settings)
        except ValidationError as exc:
            raise usage_error(exc, "trainer") from None
