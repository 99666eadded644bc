"""Every collective, every op, on gloo at W = 1, 2, 3, checked against values computed here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import shoal
from shoal.errors import UsageError


def _value(rank: int) -> torch.Tensor:
    # Distinct per rank and per element, so a wrong reduction or order cannot pass.
    return torch.arange(6, dtype=torch.float32) * (rank + 1) + rank


def _run_collectives():
    shoal.init("gloo")
    rank = shoal.rank()
    out = {}
    for op in ("sum", "avg", "max", "min", "product"):
        out[f"all_reduce_{op}"] = shoal.all_reduce(_value(rank), op=op)
        out[f"reduce_scatter_{op}"] = shoal.reduce_scatter(_rows(rank, shoal.world_size()),
                                                           op=op)
    out["all_gather"] = shoal.all_gather(_value(rank))
    out["broadcast"] = shoal.broadcast(_value(rank), src=shoal.world_size() - 1)
    out["all_gather_object"] = shoal.all_gather_object({"rank": rank})
    out["broadcast_object"] = shoal.broadcast_object(["from", rank], src=0)
    shoal.barrier()
    out["env"] = (shoal.rank(), shoal.world_size(), shoal.local_rank(), shoal.is_main(),
                  str(shoal.device()), shoal.info()["backend"])
    shoal.cleanup()
    return out


def _rows(rank: int, world: int) -> torch.Tensor:
    # Every row different, so a rank handed another rank's slice cannot pass.
    return (torch.arange(2.0 * world * 3).reshape(2 * world, 3) + 1) * (rank + 1) + rank


_REDUCE = {
    "sum": lambda xs: torch.stack(xs).sum(0),
    "avg": lambda xs: torch.stack(xs).mean(0),
    "max": lambda xs: torch.stack(xs).amax(0),
    "min": lambda xs: torch.stack(xs).amin(0),
    "product": lambda xs: torch.stack(xs).prod(0),
}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_collectives_match_local_computation(world):
    results = shoal.spawn(_run_collectives, nprocs=world)
    values = [_value(r) for r in range(world)]
    for rank, out in enumerate(results):
        for op, reduce in _REDUCE.items():
            expected = reduce(values)
            torch.testing.assert_close(out[f"all_reduce_{op}"], expected, rtol=1e-6, atol=0)
            scattered = reduce([_rows(r, world) for r in range(world)]).chunk(world)[rank]
            torch.testing.assert_close(out[f"reduce_scatter_{op}"], scattered, rtol=1e-6,
                                       atol=0)
        for got, want in zip(out["all_gather"], values, strict=True):
            assert torch.equal(got, want)
        assert torch.equal(out["broadcast"], values[-1])
        assert out["all_gather_object"] == [{"rank": r} for r in range(world)]
        assert out["broadcast_object"] == ["from", 0]
        assert out["env"] == (rank, world, rank, rank == 0, "cpu", "gloo")


def test_invalid_op_and_avg_of_integers(single_process):
    with pytest.raises(UsageError, match="op must be one of"):
        shoal.all_reduce(torch.ones(2), op="mean")
    with pytest.raises(UsageError, match="floating-point"):
        shoal.all_reduce(torch.ones(2, dtype=torch.int64), op="avg")
    with pytest.raises(UsageError, match="divisible"):
        shoal.reduce_scatter(torch.ones(()))


def test_init_without_launcher_is_world_of_one():
    code = (
        "import shoal, torch\n"
        "env = shoal.init(); assert shoal.init() is env\n"
        "t = shoal.all_reduce(torch.tensor([2.0]), op='avg')\n"
        "print(shoal.world_size(), shoal.rank(), t.item(), shoal.info()['backend'])\n"
        "shoal.cleanup(); shoal.cleanup()\n"
    )
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "2.0", "gloo"]


def test_spawn_reports_failing_rank_with_traceback():
    with pytest.raises(shoal.WorkerFailedError) as info:
        shoal.spawn(_fail_on_rank_one, nprocs=2)
    assert info.value.rank == 1
    assert "raised ZeroDivisionError" in info.value.cause
    assert "return 1 / 0" in info.value.traceback
    assert "_fail_on_rank_one" in info.value.traceback


def _fail_on_rank_one():
    shoal.init("gloo")
    if shoal.rank() == 1:
        return 1 / 0
    shoal.barrier()
