"""The job's topology: how many ranks split the data, the layers' tensors and the layers.

``ParallelDims`` is the one place where degrees are checked and multiplied; everything else
asks it (``dims.dp``, ``dims.tp_enabled``, ``dims.build_mesh("cpu")["dp"]``). It is also
the ``trainer.parallel`` section of a run config:

    trainer:
      parallel: {tp: 2}        # dp: whatever is left, world size / (tp x pp)
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shoal.errors import UsageError

# Outermost first: pipeline stages talk least often, tensor-parallel peers most often, so
# tensor-parallel ranks are neighbours (the same host, where there is a choice).
MESH_DIMS = ("pp", "dp", "tp")


class ParallelDims(BaseModel):
    """Degrees of data, tensor and pipeline parallelism; their product is the world size."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    dp: int | None = Field(None, gt=0)
    """Data-parallel degree: model replicas (ddp, zero1) or shards (zero2, fsdp). Default:
    whatever is left, world size / (tp x pp)."""
    tp: int = Field(1, gt=0)
    """Tensor-parallel degree: ranks that split each layer's weights (attention heads)."""
    pp: int = Field(1, gt=0)
    """Pipeline-parallel degree: ranks that each hold a consecutive slice of the blocks."""

    _world_size: int | None = PrivateAttr(None)

    def resolve(self, world_size: int) -> ParallelDims:
        """These degrees for a job of ``world_size`` processes, dp filled in; checked here,
        once. A mismatch raises a UsageError that says which degrees to change."""
        model = self.tp * self.pp
        if self.dp is None:
            if world_size % model:
                raise UsageError(
                    f"trainer.parallel: tp {self.tp} x pp {self.pp} = {model} does not divide "
                    f"the job's {_processes(world_size)}: choose tp and pp whose product "
                    f"divides {world_size}, or run {_multiple(model, world_size)} processes")
            dp = world_size // model
        else:
            dp = self.dp
            if dp * model != world_size:
                raise UsageError(
                    f"trainer.parallel: dp {dp} x tp {self.tp} x pp {self.pp} = "
                    f"{dp * model}, but the job has {_processes(world_size)}: set degrees "
                    f"whose product is {world_size} (or leave dp unset: it takes what "
                    f"tp x pp leave), or run {dp * model} processes")
        dims = ParallelDims(dp=dp, tp=self.tp, pp=self.pp)
        dims._world_size = world_size
        return dims

    def validate_model(self, n_layer: int | None = None, n_head: int | None = None) -> None:
        """Check that the model can be split this way (heads over tp, blocks over pp)."""
        if n_head is not None and n_head % self.tp:
            raise UsageError(
                f"trainer.parallel.tp: the model's {n_head} attention heads cannot be split "
                f"evenly over tp {self.tp} ranks: choose a tp that divides {n_head}")
        if n_layer is not None and self.pp > n_layer:
            raise UsageError(
                f"trainer.parallel.pp: {self.pp} pipeline stages, but the model has only "
                f"{n_layer} block{'s' if n_layer != 1 else ''}: choose pp <= {n_layer}")

    @property
    def world_size(self) -> int:
        if self._world_size is None:
            raise RuntimeError("ParallelDims.resolve(world_size) first")
        return self._world_size

    @property
    def dp_enabled(self) -> bool:
        return (self.dp or 1) > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def model_parallel(self) -> bool:
        """The model itself is split (tensor or pipeline parallel)."""
        return self.tp_enabled or self.pp_enabled

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``rank``'s place (pp, dp, tp) in the mesh: ranks are laid out row-major over
        ("pp", "dp", "tp"), as ``build_mesh`` builds it. Needs no communication."""
        if self.dp is None:
            raise RuntimeError("ParallelDims.resolve(world_size) first")
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The device mesh, dimensions named ("pp", "dp", "tp"), degree-1 ones included
        (``mesh["tp"]`` always exists; a dimension of one rank costs nothing to speak of).
        Collective: every rank of the job calls it."""
        if self.dp is None:
            raise RuntimeError("ParallelDims.resolve(world_size) first")
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp),
                                mesh_dim_names=MESH_DIMS)


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def _multiple(model: int, world_size: int) -> int:
    """The nearest process count above ``world_size`` that ``model`` divides."""
    return -(-world_size // model) * model
