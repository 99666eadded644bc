"""The piecewise API: the Trainer's machinery for users who keep their own loop.

    harness = shoal.Harness(precision="bf16-mixed")
    model, optimizer = harness.setup(model, optimizer)
    loader = harness.setup_dataloader(dataset, batch_size=32)
    for batch in loader:
        batch = harness.to_device(batch)                 # any structure: pairs, dicts, ...
        with harness.no_sync(model, enabled=not last_micro_batch):
            with harness.autocast():
                loss = model(**batch).loss               # or loss_fn(model(x), y)
            harness.backward(loss)
        harness.step(optimizer, clip_grad_norm=1.0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast, overload

import torch
from pydantic import ValidationError
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset

from shoal.data.sampler import ElasticSampler
from shoal.data.sharding import EvalShardSampler, shard_dataloader
from shoal.errors import UsageError
from shoal.ft.across import apply_across_groups, averages_in_hook
from shoal.parallel.activation_checkpoint import apply_activation_checkpointing
from shoal.parallel.averaging import (
    DiLoCoConfig,
    LocalSGDConfig,
    apply_diloco,
    apply_local_sgd,
)
from shoal.parallel.blocks import find_blocks
from shoal.parallel.comm import Comm
from shoal.parallel.compile import apply_compile
from shoal.parallel.compression import CompressionConfig, apply_compression
from shoal.parallel.ddp import DDPConfig, apply_ddp
from shoal.parallel.fsdp import (
    FSDPConfig,
    FSDPTraffic,
    apply_fsdp,
    broadcast_from_first,
    follow_parameters,
    parameter_names,
)
from shoal.parallel.grad_norm import clip_grad_norm_, total_norm
from shoal.parallel.materialize import Init, initializer, materialize, on_meta
from shoal.parallel.pipeline_parallel import PipelineConfig, PipelineModel, apply_pp
from shoal.parallel.replicate import ReplicateTraffic, apply_replicate
from shoal.parallel.tensor_parallel import TensorParallelConfig, apply_tp
from shoal.parallel.topology import ParallelDims
from shoal.parallel.traffic import StepComm, Traffic
from shoal.parallel.zero import ZeroTraffic, apply_zero1
from shoal.runtime import dist as rt
from shoal.training.batches import leaves, move_to_device
from shoal.training.precision import Precision


def _on_cpu(data: Dataset | DataLoader) -> bool:
    """A map-style dataset whose samples are CPU tensors (which can be pinned); judged by
    its first sample."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(dataset, IterableDataset):
        return False
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - an empty or odd dataset: no pinning, no judgment
        return False
    return all(t.device.type == "cpu" for t in leaves(sample) if isinstance(t, torch.Tensor))


def _full(norm: torch.Tensor) -> torch.Tensor:
    """A norm of sharded (DTensor) gradients is a replicated DTensor: the plain value."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class Harness:
    """Wraps model, optimizer and data for the chosen strategy and precision.

    ``live``: this process is a replica group's, in a live job (the Trainer's, under
    shoal's launcher): under ddp a group of one process averages across the groups inside
    DDP's hook (``shoal.ft.across``).

    Raises:
        UsageError: If a setting is unknown or invalid (the Trainer's checks), the backend
            cannot run here, or the parallel degrees do not make up the world size.
        ValueError: If the launcher's environment is incomplete (see ``shoal.init``).
        RuntimeError: If the process group cannot form (see ``shoal.init``).
    """

    def __init__(self, strategy: str = "ddp", precision: str = "32", *,
                 backend: str | None = None, ddp: DDPConfig | dict | None = None,
                 compression: CompressionConfig | dict | str | None = None,
                 local_sgd: LocalSGDConfig | dict | None = None,
                 diloco: DiLoCoConfig | dict | None = None,
                 fsdp: FSDPConfig | dict | None = None,
                 parallel: ParallelDims | dict | None = None,
                 tensor_parallel: TensorParallelConfig | dict | None = None,
                 pipeline: PipelineConfig | dict | None = None,
                 tp_plan: dict | None = None,
                 activation_checkpointing: bool = False, blocks: list[str] | None = None,
                 compile: bool = False, seed: int = 0, live: bool = False):
        from shoal.training.config import TrainerConfig

        # Validate through the same schema as the Trainer, so both reject the same inputs.
        options = {"ddp": ddp, "compression": compression, "local_sgd": local_sgd,
                   "diloco": diloco, "fsdp": fsdp, "parallel": parallel, "blocks": blocks,
                   "tensor_parallel": tensor_parallel, "pipeline": pipeline}
        # The Harness has no batch size of its own (a pipeline checks each batch it gets):
        # one that the microbatches divide passes the config's check.
        try:
            micro = PipelineConfig.model_validate(pipeline or {}).microbatches
        except ValidationError:  # TrainerConfig.build says what is wrong, in one line
            micro = 1
        config = TrainerConfig.build(strategy=strategy, precision=precision, backend=backend,
                                     batch_size=micro, seed=seed, compile=compile,
                                     activation_checkpointing=activation_checkpointing,
                                     **{k: v for k, v in options.items() if v is not None})
        self.config = config
        self.env = rt.init(config.backend)
        # The topology is checked here, once, before any model or data is touched.
        self.dims = config.parallel.resolve(self.env.world_size)
        self.pp_rank, self.dp_rank, self.tp_rank = self.dims.coordinates(self.env.rank)
        self.tp_plan = tp_plan  # a user's tensor-parallel plan, instead of the ready one
        self.mesh: DeviceMesh | None = None  # built when a strategy needs one
        self.device = rt.device()
        self.precision = Precision(config.precision, self.device, sharded=self.sharded)
        self.traffic = Traffic()
        self.comm: Comm = Comm()
        """The strategy's communication (``shoal.parallel.comm.Comm``)."""
        self.last_comm = StepComm(0.0, 0.0, 0.0)  # what the last step sent and waited for
        self.last_grad_norm: torch.Tensor | None = None
        # Live recovery: (count, index) of the replica groups whose data this job splits.
        self.replica_groups = (1, 0)
        self.live = live
        self.settle_due = False
        """This process continues a run past its first step: DDP settles its buckets before
        the step (``shoal.training.settling``; across live groups, their hook's flag)."""

    @property
    def data_ranks(self) -> int:
        """Data-parallel ranks over the whole job (every replica group's)."""
        assert self.dims.dp is not None  # resolved in __init__
        return self.dims.dp * self.replica_groups[0]

    @property
    def data_rank(self) -> int:
        """This rank's index among ``data_ranks``."""
        assert self.dims.dp is not None  # resolved in __init__
        return self.replica_groups[1] * self.dims.dp + self.dp_rank

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def sharded(self) -> bool:
        """Parameters are sharded DTensors ('zero2', 'fsdp'): each rank holds a part."""
        return self.config.strategy in ("zero2", "fsdp")

    @property
    def split(self) -> bool:
        """Each rank holds a part of the model (sharded, or split by tp or pp)."""
        return self.sharded or self.dims.model_parallel

    @property
    def model_parallel(self) -> bool:
        """The model itself is split over ranks (tp or pp > 1)."""
        return self.dims.model_parallel

    @property
    def pp_group(self) -> torch.distributed.ProcessGroup | None:
        """The ranks holding the other pipeline stages (None without pp)."""
        return self._mesh()["pp"].get_group() if self.dims.pp_enabled else None

    @overload
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any = None
              ) -> tuple[nn.Module | PipelineModel, torch.optim.Optimizer]: ...

    @overload
    def setup(self, model: nn.Module, optimizer: None = None, loss_fn: Any = None
              ) -> tuple[nn.Module | PipelineModel, None]: ...

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              loss_fn: Any = None) -> tuple[nn.Module | PipelineModel,
                                            torch.optim.Optimizer | None]:
        """Move ``model`` to this rank's device and apply the strategy to it.

        Under ddp, zero1, zero2 and fsdp every rank starts from rank 0's weights.
        ``Module.to`` keeps the Parameter objects, so ``optimizer`` stays valid; FSDP
        replaces them by sharded ones and ``optimizer`` is pointed at those.
        Under 'zero1' the returned optimizer is a new one (ZeroRedundancyOptimizer): build
        an LR scheduler on it.

        With pipeline parallelism (pp > 1) the result is a ``PipelineModel``: train with
        its ``step(inputs, targets)``, which runs forward and backward through every stage
        and needs ``loss_fn(outputs, targets)`` (a microbatch's mean loss); ``optimizer``
        keeps only this stage's parameters.

        A model built on the meta device (with an ``init_parameter(name, tensor)``, see
        ``shoal.parallel.materialize``) gets storage only for this rank's part, after it is
        split (zero2, fsdp, tp, pp), or whole first (the replicating strategies); its
        initial values are those of the whole model, and ``optimizer`` follows them.

        Raises:
            UsageError: If the model or optimizer does not fit the strategy: parameters
                partly on the meta device or without ``init_parameter``, an optimizer that
                holds other parameters or has stepped, ``blocks`` that name no module or no
                blocks to checkpoint, no optimizer under 'zero1', no ``loss_fn`` under pp, a
                model that tp or pp cannot split, or ``ddp.sync_batchnorm`` on the CPU.
            RuntimeError: If a collective of the setup fails (a peer died), or DDP finds
                that the ranks' models differ.
        """
        c = self.config
        init = initializer(model) if on_meta(model) else None
        names = parameter_names(model, optimizer) if optimizer is not None else None
        if init is not None and not self.split:
            materialize(model, self.device, init)  # replicas: the whole model, now
            if optimizer is not None:
                assert names is not None  # taken with the optimizer
                follow_parameters(model, optimizer, names)
            init = None
        if init is None:
            model = model.to(self.device)
        if self.split:
            return self._setup_split(model, optimizer, loss_fn, init, names)
        if c.activation_checkpointing:
            apply_activation_checkpointing(model, find_blocks(model, c.blocks))
        if c.strategy == "local_sgd":
            self.comm = apply_local_sgd(model, c.local_sgd, self.traffic)
        elif c.strategy == "diloco":
            self.comm = apply_diloco(model, c.diloco, self.traffic)
        elif c.strategy == "zero1":
            if optimizer is None:
                raise UsageError("strategy 'zero1' shards the optimizer state: pass the "
                                 "optimizer to setup")
            model, optimizer = apply_zero1(model, optimizer, device=self.device, ddp=c.ddp)
            self.comm = ZeroTraffic(model, self.traffic)
        else:
            model = apply_ddp(model, self.device, c.ddp)
            if self.live and averages_in_hook(c.strategy, c.compression.name,
                                              self.env.world_size):
                self.comm = apply_across_groups(model, self.traffic, c.compression)
            else:
                self.comm = apply_compression(model, c.compression, self.traffic, seed=c.seed)
        if c.compile:  # after the wrapper: torch's DDP splits the graph at its buckets
            apply_compile(model)
        return model, optimizer

    def _setup_split(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     loss_fn: Any, init: Init | None, names: list[list[str]] | None
                     ) -> tuple[nn.Module | PipelineModel, torch.optim.Optimizer | None]:
        """A model of which each rank holds a part (zero2, fsdp, tp, pp), in torchtitan's
        order: tensor parallel, activation checkpointing, the data-parallel wrapper (of
        each pipeline stage: FSDP must see the checkpointed blocks to shard them as
        units), the pipeline."""
        c, dims = self.config, self.dims
        if dims.model_parallel:
            blocks = getattr(model, "blocks", None)
            dims.validate_model(
                n_layer=len(blocks) if isinstance(blocks, nn.ModuleList) else None,
                n_head=getattr(getattr(model, "config", None), "n_head", None))
            # Pieces of one rank's model must fit together: everyone starts from rank 0's
            # (the dp wrappers below give their ranks the first one's).
            broadcast_from_first(model)
        if dims.pp_enabled and loss_fn is None:
            raise UsageError("pipeline parallelism computes the loss on the last stage: pass "
                             "loss_fn to setup")
        mesh = self._mesh()
        if dims.tp_enabled:
            apply_tp(model, mesh["tp"], None if self.tp_plan else c.tensor_parallel,
                     plan=self.tp_plan)
        blocks = find_blocks(model, c.blocks) \
            if c.activation_checkpointing or self.sharded or dims.dp_enabled or c.compile \
            else None
        if c.activation_checkpointing:
            assert blocks is not None  # found above for activation checkpointing
            apply_activation_checkpointing(model, blocks)
        if c.compile:  # block by block, before FSDP makes each block a unit
            apply_compile(model, blocks)

        def data_parallel(module: nn.Module, blocks: list[nn.Module] | None) -> nn.Module:
            assert dims.dp is not None  # resolved in __init__
            if self.sharded:
                reshard = c.strategy == "fsdp"
                # Counted before sharding, from the whole parameters.
                self.comm = FSDPTraffic(module, self.traffic, dims.dp, c.fsdp, reshard)
                apply_fsdp(module, mesh["dp"], c.fsdp, blocks=blocks,
                           reshard_after_forward=reshard)
            elif dims.dp_enabled:  # 'ddp': whole (stages of) split models on each dp rank
                self.comm = ReplicateTraffic(module, self.traffic, dims.dp)
                apply_replicate(module, mesh["dp"], blocks)
            # Built on meta: now that it is split, this rank's part gets its values.
            return materialize(module, self.device, init) if init is not None else module

        if dims.pp_enabled:
            pipeline = apply_pp(model, mesh["pp"], c.pipeline, loss_fn,
                                parallelize_stage=lambda stage: data_parallel(
                                    stage, list(cast(nn.ModuleDict, stage.blocks).values())
                                    if blocks else None))
            if optimizer is not None:
                assert names is not None  # taken with the optimizer
                follow_parameters(pipeline.stage, optimizer, names, only_present=True)
            return pipeline, optimizer
        model = data_parallel(model, blocks)
        if optimizer is not None:
            assert names is not None  # taken with the optimizer
            follow_parameters(model, optimizer, names)
        return model, optimizer

    def _mesh(self) -> DeviceMesh:
        if self.mesh is None:
            self.mesh = self.dims.build_mesh(self.device.type)
        return self.mesh

    def synchronize(self) -> None:
        """local_sgd / diloco: bring every replica to the shared model now (at the end of
        training; the Trainer does it before its last validation). No-op for ddp.

        Raises:
            RuntimeError: If the weight exchange fails (a peer died, or the group's timeout
                passed).
        """
        self.comm.synchronize()
        self.traffic.end_step(step=False)  # (outside any step; nothing where none was sent)

    @property
    def comm_kind(self) -> str:
        """The strategy, and for 'ddp' the compression: 'ddp/topk', 'diloco', ..."""
        c = self.config
        return f"ddp/{c.compression.name}" if c.strategy == "ddp" else c.strategy

    def comm_state_dict(self) -> dict:
        """State of the compression or weight averaging (checkpointed per rank).

        Never raises.
        """
        state = self.comm.state_dict()
        return {"kind": self.comm_kind, "state": state}

    def load_comm_state_dict(self, state: dict) -> None:
        self.comm.load_state_dict(state)

    def setup_dataloader(self, data: Dataset | DataLoader, batch_size: int = 32, *,
                         shuffle: bool = True, evaluation: bool = False,
                         num_workers: int = 0, share: int | None = None) -> DataLoader:
        """A loader over this rank's share of ``data`` (see ``shard_dataloader``): shares
        go to the dp ranks; the tp and pp ranks of one dp rank read the same batches.
        Pipeline training needs full batches: an epoch's incomplete last one is dropped.
        ``share`` (evaluation): the share of that data rank instead of this rank's own (a
        live replica group validates every group's, see ``validation_shares``).

        Raises:
            UsageError: If ``data`` is a DataLoader whose sampler shoal cannot split over
                the ranks, or, under tp or pp, a loader whose batches shoal does not split.
            ValueError: If ``batch_size`` is below 1.
        """
        assert self.dims.dp is not None  # resolved in __init__
        rank = share if evaluation and share is not None else self.data_rank
        loader = shard_dataloader(data, world_size=self.data_ranks, rank=rank,
                                  batch_size=batch_size, shuffle=shuffle and not evaluation,
                                  seed=self.config.seed, evaluation=evaluation,
                                  num_workers=num_workers,
                                  drop_last=self.dims.pp_enabled and not evaluation,
                                  pin_memory=self.device.type == "cuda" and _on_cpu(data))
        if self.model_parallel and not isinstance(loader.sampler,
                                                  (ElasticSampler, EvalShardSampler)):
            custom = loader.batch_sampler is not None \
                and type(loader.batch_sampler) is not BatchSampler
            kind = type(loader.dataset if isinstance(loader.dataset, IterableDataset) else
                        loader.batch_sampler if custom else loader.sampler).__name__
            raise UsageError(f"with tensor or pipeline parallelism shoal splits the data "
                             f"itself (the tp and pp ranks of a dp rank must read the same "
                             f"batches), which it cannot do for this loader's {kind}: pass "
                             "a map-style Dataset, or a DataLoader with a plain sampler")
        return loader

    def validation_shares(self) -> list[int]:
        """The data ranks whose validation shares this rank evaluates: its own and, in a
        live job, the same dp rank's of every other replica group. Each group validates
        the whole set, split in the very batches that DDP over all groups' ranks uses, so
        that it reports DDP's figures without waiting for another group.

        Never raises.
        """
        assert self.dims.dp is not None  # resolved in __init__
        return [group * self.dims.dp + self.dp_rank for group in range(self.replica_groups[0])]

    def to_device(self, batch: Any) -> Any:
        """``batch`` on this rank's device, whatever its structure (pairs, tuples, dicts,
        dataclasses, nested; see ``shoal.training.batches``).

        Never raises.
        """
        return move_to_device(batch, self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Run the forward pass in the configured precision.

        Never raises.
        """
        return self.precision.autocast()

    def pipeline_step(self, pipeline: PipelineModel, inputs: torch.Tensor,
                      targets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """pp > 1: forward and backward of one batch through every stage, in the configured
        precision, instead of ``model(x)`` and ``backward``. Adds the gradients of ``scale``
        times the batch's mean loss; returns that mean loss on every rank.

        Raises:
            UsageError: If the batch does not cut into the configured microbatches, or
                ``inputs`` and ``targets`` differ in length.
            RuntimeError: If the exchange between the stages fails (a peer died).
        """
        with self.autocast():
            loss = pipeline.step(inputs, targets, scale)
        self.comm.after_backward()  # (dp traffic, as one backward)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass, with loss scaling under fp16.

        Raises:
            RuntimeError: If ``loss`` does not require a gradient, or the gradient all-reduce
                fails (a peer died, or the group's timeout passed).
        """
        self.precision.backward(loss)
        self.comm.after_backward()

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module, enabled: bool = True) -> Iterator[None]:
        """Skip the gradient all-reduce for backward passes inside (accumulation micro-batches).

        Gradients accumulate locally; the next backward outside the block all-reduces them all.

        Never raises.
        """
        if enabled and isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        elif enabled and isinstance(model, FSDPModule):
            # No reduce-scatter: each rank keeps its whole unsharded gradients meanwhile.
            counted = self.comm if isinstance(self.comm, FSDPTraffic) else None
            model.set_requires_gradient_sync(False)
            if counted is not None:
                counted.syncing = False
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
                if counted is not None:
                    counted.syncing = True
        else:
            yield

    def step(self, optimizer: torch.optim.Optimizer, *,
             model: nn.Module | PipelineModel | None = None,
             clip_grad_norm: float | None = None, check_finite: bool = False,
             measure_norm: bool = False) -> bool:
        """Optimizer step (unscale, optional clipping, skip on fp16 overflow), then zero_grad.

        With ``check_finite``, a NaN or Inf gradient norm skips the step and returns False.
        Gradients are all-reduced before this, so every rank sees the same norm and every
        rank skips the same steps (sharded gradients: the norm is over all the shards). The
        gradient norm, when computed (clipping, the finite check or ``measure_norm``), is
        kept in ``last_grad_norm`` as a tensor.

        Raises:
            RuntimeError: If a collective of the step fails (a peer died): the norm of
                sharded or split gradients, or the exchanges of 'zero1', 'local_sgd' and
                'diloco'.
        """
        norm = None
        if clip_grad_norm is not None or check_finite or measure_norm:
            self.precision.unscale(optimizer)
            params = list(model.parameters() if model is not None else (
                p for group in optimizer.param_groups for p in group["params"]))
            if self.model_parallel:  # pieces of several kinds and meshes, stages apart
                norm = clip_grad_norm_(params, clip_grad_norm, self.pp_group) \
                    if clip_grad_norm is not None else total_norm(params, self.pp_group)
            elif clip_grad_norm is not None:
                norm = _full(torch.nn.utils.clip_grad_norm_(params, clip_grad_norm))
            else:
                norm = _full(torch.nn.utils.get_total_norm(
                    [p.grad for p in params if p.grad is not None]))
        self.last_grad_norm = norm
        if check_finite and not torch.isfinite(cast(torch.Tensor, norm)):  # computed above
            if self.precision.scaler is not None:
                self.precision.scaler.update()  # lower the loss scale, as an overflow does
            optimizer.zero_grad(set_to_none=True)
            self.last_comm = self.traffic.end_step()
            return False
        self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.comm.after_step()  # (local_sgd / diloco meet every few steps)
        self.last_comm = self.traffic.end_step()
        return True
