"""Pipeline parallel: the blocks are split into consecutive stages, one per rank of a "pp" mesh.

The first stage also holds the embeddings, the last one the final norm, the head and the
loss. A batch is cut into microbatches that flow through the stages in the order of a torch
``torch.distributed.pipelining`` schedule:

    gpipe  all forwards, then all backwards: simple; activations of every microbatch live
           at once.
    1f1b   after a warm-up, one forward then one backward: at most ``stages`` microbatches'
           activations live at once. Needs microbatches >= stages.

Each microbatch's loss is its mean, back-propagated divided by the number of microbatches,
so the summed gradient is the full batch's mean-loss gradient, as without pipelining.
Successive ``step`` calls add their gradients up (accumulation), each weighted by its
``scale``. The model must have the structure of ``shoal.examples.gpt.GPT``: ``embed``,
``blocks`` (a ModuleList), ``logits``, with ``tok_emb``/``pos_emb`` used by ``embed`` and
``norm``/``head`` by ``logits``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from shoal.errors import UsageError

# torch.distributed.pipelining is imported in apply_pp only: it pulls in torch's compiler
# (over a second per process), which runs without pipelining never need.
_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
_EMBED = ("tok_emb", "pos_emb")  # what ``model.embed`` reads: the first stage's
_HEAD = ("norm", "head")  # what ``model.logits`` reads: the last stage's


class PipelineConfig(BaseModel):
    """How a batch goes through the pipeline."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """Order of the microbatches' forwards and backwards: 'gpipe' (all forwards, then all
    backwards) or '1f1b' (alternating; less activation memory, needs microbatches >=
    stages)."""
    microbatches: int = Field(4, ge=1)
    """Pieces each batch is cut into; the batch size must be a multiple. More microbatches
    shrink the pipeline's idle time (about (stages - 1) / (microbatches + stages - 1))."""


def split_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """Consecutive, near-equal runs of block indices, one per stage; earlier stages get the
    extra blocks, as the last stage also computes the head and the loss."""
    if n_stages > n_blocks:
        raise UsageError(f"pipeline of {n_stages} stages for a model of {n_blocks} blocks: "
                         f"each stage needs at least one block; use pp <= {n_blocks}")
    base, extra = divmod(n_blocks, n_stages)
    bounds = [0]
    for stage in range(n_stages):
        bounds.append(bounds[-1] + base + (stage < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


class _Stage(nn.Module):
    """One stage's modules, registered under the model's own names so that ``state_dict``
    keys are the unsplit model's (``blocks.2.attn.q.weight``, not ``blocks.0...``)."""

    def __init__(self, model: nn.Module, blocks: dict[int, nn.Module], is_first: bool,
                 is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        # The model's own embed/logits are the ends of the first and last stages; the model
        # is kept as a plain attribute (bound methods), not as a submodule.
        self._embed = cast("Callable[[torch.Tensor], torch.Tensor]", model.embed)
        self._logits = cast("Callable[[torch.Tensor], torch.Tensor]", model.logits)
        for name, child in model.named_children():
            if name != "blocks" and child is not None:
                self.add_module(name, child)
        self.blocks = nn.ModuleDict({str(i): block for i, block in blocks.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self._embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self._logits(x)
        return x


class _ScaledLoss:
    """The loss the schedule back-propagates: ``loss_fn`` times ``scale / microbatches``.

    Scaling the loss rather than the gradients (torch's ``scale_grads``) leaves gradients
    of earlier steps alone, so they accumulate. The plain losses are kept for reporting
    (the schedule also calls it while it sets the stages up, the first step and after a
    switch between training and evaluation: only the last ``microbatches`` count).
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 microbatches: int):
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.scale = 1.0
        self.losses: list[torch.Tensor] = []

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(outputs, targets)
        self.losses.append(loss.detach())
        return loss * (self.scale / self.microbatches)


class PipelineModel:
    """This rank's stage and the schedule that runs it; what training code holds instead of
    the model. Every rank of the pipeline calls ``step`` with the same batch."""

    def __init__(self, stage: _Stage, module: nn.Module, schedule: Any, loss: _ScaledLoss,
                 pp_mesh: DeviceMesh, config: PipelineConfig, blocks: range):
        self.stage = stage
        """This rank's stage, unwrapped: its names are the original model's."""
        self.module = module
        """The stage as the schedule runs it (after ``parallelize_stage``)."""
        self.config = config
        self.blocks = blocks
        """Indices of the model's blocks held here."""
        self.stage_index = pp_mesh.get_local_rank()
        self.num_stages = pp_mesh.size()
        self._schedule = schedule
        self._loss = loss
        # torch sets the stages up again when training and evaluation alternate; within
        # an evaluation their buffers keep the first batch's shape.
        self._eval_batch: int | None = None
        self._group = pp_mesh.get_group()
        self._device = _device(pp_mesh)

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, scale: float = 1.0
             ) -> torch.Tensor:
        """Forward and backward of one batch through every stage; the gradients of the
        batch's mean loss times ``scale`` are added to this stage's parameters' (as
        ``(loss * scale).backward()`` would). Returns the batch's mean loss (detached,
        unscaled) on every rank."""
        self._check_batch(inputs, targets)
        self._eval_batch = None
        args = (inputs,) if self.is_first else ()
        self._loss.scale, self._loss.losses = scale, []
        if self.is_last:
            self._schedule.step(*args, target=targets, return_outputs=False)
            # The last ones: setting the stages up also calls the loss once, on a sample.
            loss = torch.stack(self._loss.losses[-self.config.microbatches:]).mean()
        else:
            self._schedule.step(*args, return_outputs=False)
            loss = torch.zeros((), device=self._device)
        # For logging on every rank: the last stage has it.
        dist.broadcast(loss, group=self._group, group_src=self.num_stages - 1)
        return loss

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward only: the model's outputs for ``inputs`` on the last stage, None on the
        others (the schedule computes the loss too: it needs ``targets``). The stages
        exchange buffers of one shape from the first evaluation after training on (that
        batch rounded up to whole microbatches): a shorter batch is padded with copies of
        its last sample, whose outputs are dropped."""
        n, micro = inputs.shape[0], self.config.microbatches
        self._eval_batch = self._eval_batch or -(-n // micro) * micro
        inputs = _padded(inputs, self._eval_batch)
        targets = _padded(targets, self._eval_batch)
        self._check_batch(inputs, targets)
        args = (inputs,) if self.is_first else ()
        self._loss.losses = []
        outputs = self._schedule.eval(*args, target=targets if self.is_last else None)
        return outputs[:n] if self.is_last else None

    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        batch, micro = inputs.shape[0], self.config.microbatches
        if batch % micro or targets.shape[0] != batch:
            raise UsageError(f"a batch of {batch} inputs and {targets.shape[0]} targets "
                             f"cannot be cut into {micro} equal microbatches: use a batch "
                             f"size that is a multiple of {micro}")

    def parameters(self) -> Iterator[nn.Parameter]:
        """This stage's parameters, for its optimizer."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.stage.named_parameters()

    def train(self, mode: bool = True) -> PipelineModel:
        self.module.train(mode)
        return self

    def eval(self) -> PipelineModel:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    def state_dict(self) -> dict[str, Any]:
        """This stage's tensors under the unsplit model's names; the union over the stages
        is the whole model's state_dict."""
        return self.stage.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load this stage's entries from a state dict of this stage or of the whole model
        (tensors of the kind ``state_dict`` returns: plain ones unless the stage is sharded)."""
        own = self.stage.state_dict().keys()
        self.stage.load_state_dict({k: v for k, v in state_dict.items() if k in own},
                                   strict=strict)


def apply_pp(model: nn.Module, pp_mesh: DeviceMesh, config: PipelineConfig,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
             parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
             ) -> PipelineModel:
    """Keep this rank's stage of ``model`` and return the ``PipelineModel`` that trains it
    over the 1-D ``pp_mesh``; use that from now on, as ``model`` loses the other stages'
    modules (their memory is freed) and can no longer run alone.

    ``loss_fn(outputs, targets)`` is the mean loss of one microbatch, computed on the last
    stage. ``parallelize_stage`` is applied to the stage module before the schedule is
    built: the place for tensor parallelism (``apply_tp``) and for the data-parallel
    wrapper over the dp mesh (``apply_fsdp`` or ``apply_replicate``; not DDP) on a mesh
    of more dimensions. The mesh, the schedule,
    the model's structure and the split are checked before the model is changed.
    """
    if pp_mesh.ndim != 1:
        raise UsageError(f"apply_pp needs a 1-D mesh, got {pp_mesh.ndim} dimensions "
                         f"{pp_mesh.mesh_dim_names}: pass the sub-mesh, e.g. mesh['pp']")
    n_stages = pp_mesh.size()
    if config.schedule == "1f1b" and config.microbatches < n_stages:
        raise UsageError(f"schedule '1f1b' needs at least as many microbatches as stages: "
                         f"got {config.microbatches} for {n_stages} stages; raise "
                         f"microbatches to {n_stages} or use schedule 'gpipe'")
    _check_structure(model)
    assert isinstance(model.blocks, nn.ModuleList)  # _check_structure raised otherwise
    splits = split_blocks(len(model.blocks), n_stages)

    index = pp_mesh.get_local_rank()
    is_first, is_last = index == 0, index == n_stages - 1
    blocks = splits[index]
    own = {i: model.blocks[i] for i in blocks}
    # Drop the other stages' modules: their parameters are freed once no one holds them.
    for name in ("blocks",) + (() if is_first else _EMBED) + (() if is_last else _HEAD):
        setattr(model, name, None)
    stage = _Stage(model, own, is_first, is_last)

    module = parallelize_stage(stage) if parallelize_stage is not None else stage
    if isinstance(module, DistributedDataParallel):
        # torch's schedules call DDP's reducer by hand; with microbatches it fails on the
        # second step, or with static_graph=True averages wrong gradients without a word.
        raise UsageError("a pipeline stage cannot be wrapped in DistributedDataParallel: "
                         "replicate it over the dp mesh with shoal.parallel.replicate."
                         "apply_replicate, or shard it with shoal.parallel.fsdp.apply_fsdp")
    from torch.distributed import pipelining

    pipeline_stage = pipelining.PipelineStage(module, index, n_stages, _device(pp_mesh),
                                              group=pp_mesh.get_group())
    loss = _ScaledLoss(loss_fn, config.microbatches)
    schedule_class = getattr(pipelining, _SCHEDULES[config.schedule])
    schedule = schedule_class(pipeline_stage, n_microbatches=config.microbatches,
                              loss_fn=loss, scale_grads=False)
    return PipelineModel(stage, module, schedule, loss, pp_mesh, config, blocks)


def _padded(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """``tensor`` with copies of its last row appended up to ``size`` rows."""
    missing = size - tensor.shape[0]
    if missing <= 0:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(missing, *tensor.shape[1:])])


def placed_in_stage(name: str) -> bool:
    """Whether the unsplit model's parameter (or state) ``name`` is one the pipeline gives
    to a single stage: a block's, the embeddings' or the head's."""
    return name.split(".", 1)[0] in ("blocks", *_EMBED, *_HEAD)


def _check_structure(model: nn.Module) -> None:
    blocks = getattr(model, "blocks", None)
    missing = [n for n in ("embed", "logits") if not callable(getattr(model, n, None))]
    if not isinstance(blocks, nn.ModuleList) or missing:
        raise UsageError(f"apply_pp splits models shaped like shoal.examples.gpt.GPT (embed, "
                         f"blocks as a ModuleList, logits); {type(model).__name__} lacks "
                         f"{', '.join(missing or ['blocks'])}")
    placed = set(_EMBED + _HEAD) | {"blocks"}
    stray = [name for name, child in model.named_children()
             if name not in placed and any(True for _ in child.parameters())]
    if stray:
        raise UsageError(f"apply_pp does not know which stage holds {', '.join(stray)}: "
                         f"only {', '.join(sorted(placed))} may have parameters")


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
