"""ParallelDims: degrees checked once, against the world size and the model, each mistake
one line that says what to change; the Trainer and `shoal train` fail before training."""

from __future__ import annotations

import pytest
import torch

import shoal
from shoal.errors import UsageError
from shoal.examples import gpt
from shoal.parallel.topology import ParallelDims
from tests.helpers import run_shoal


def _error(call) -> str:
    with pytest.raises(UsageError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("given, world, expected", [
    ({}, 4, (4, 1, 1)),
    ({"tp": 2}, 4, (2, 2, 1)),
    ({"pp": 2, "tp": 2}, 8, (2, 2, 2)),
    ({"dp": 1, "tp": 2, "pp": 3}, 6, (1, 2, 3)),
])
def test_dp_takes_what_is_left(given, world, expected):
    dims = ParallelDims(**given).resolve(world)
    assert (dims.dp, dims.tp, dims.pp) == expected
    assert dims.world_size == world
    assert dims.dp_enabled == (expected[0] > 1)
    assert dims.tp_enabled == (expected[1] > 1)
    assert dims.pp_enabled == (expected[2] > 1)


def test_product_must_be_the_world_size():
    message = _error(lambda: ParallelDims(dp=2, tp=3).resolve(4))
    assert "dp 2 x tp 3 x pp 1 = 6, but the job has 4 processes" in message
    message = _error(lambda: ParallelDims(tp=3).resolve(4))
    assert "tp 3 x pp 1 = 3 does not divide the job's 4 processes" in message
    assert "run 6 processes" in message


def test_model_must_fit_the_degrees():
    assert "heads cannot be split evenly over tp 3" in _error(
        lambda: ParallelDims(tp=3).validate_model(n_layer=4, n_head=4))
    assert "choose pp <= 4" in _error(
        lambda: ParallelDims(pp=6).validate_model(n_layer=4, n_head=4))
    ParallelDims(tp=2, pp=4).validate_model(n_layer=4, n_head=4)


def test_mesh_has_named_dimensions(single_process):
    mesh = ParallelDims().resolve(1).build_mesh("cpu")
    assert mesh.mesh_dim_names == ("pp", "dp", "tp")
    assert mesh["dp"].size() == mesh["tp"].size() == 1


def _tiny(n_layer: int = 2, n_head: int = 2) -> torch.nn.Module:
    return gpt.build_model(vocab_size=16, seq_len=4, n_layer=n_layer, n_head=n_head,
                           d_model=6 * n_head)


def test_trainer_rejects_a_topology_before_training(single_process):
    model = _tiny()
    message = _error(lambda: shoal.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           strategy="fsdp", parallel={"dp": 2}))
    assert "dp 2 x tp 1 x pp 1 = 2, but the job has 1 process" in message


def _model_errors() -> list[str]:
    shoal.init("gloo")
    errors = []
    for model, parallel in ((_tiny(n_head=3), {"tp": 2}), (_tiny(n_layer=1), {"pp": 2})):
        try:
            shoal.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          parallel=parallel, progress=False)
        except UsageError as exc:
            errors.append(str(exc))
    return errors


def test_trainer_rejects_a_model_the_degrees_do_not_fit():
    for errors in shoal.spawn(_model_errors, nprocs=2):
        assert len(errors) == 2
        assert "the model's 3 attention heads cannot be split evenly over tp 2" in errors[0]
        assert "2 pipeline stages, but the model has only 1 block" in errors[1]


def test_shoal_train_exits_2_with_one_line():
    # One process: the Trainer is built in the CLI's own process, which reports a
    # UsageError as one line and exit code 2.
    out = run_shoal("train", "--config", "examples/digits.yaml", "--nproc-per-node", "1",
                    "trainer.parallel.tp=2", "trainer.strategy=fsdp")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "tp 2 x pp 1 = 2 does not divide the job's 1 process" in lines[0]


def test_config_rejects_model_parallel_local_strategies():
    message = _error(lambda: shoal.TrainerConfig.build(strategy="diloco",
                                                       parallel={"tp": 2}))
    assert "strategy 'diloco' cannot be combined with tensor or pipeline" in message


@pytest.mark.parametrize("settings, expected", [
    ({"strategy": "zero1", "parallel": {"pp": 2}}, "strategy 'zero1' cannot be combined"),
    ({"parallel": {"pp": 2}, "batch_size": 6}, "microbatches 4 must divide batch_size 6"),
    ({"parallel": {"pp": 4}, "pipeline": {"microbatches": 2}, "batch_size": 8},
     "'1f1b' needs microbatches >= stages: got 2 for pp 4"),
    ({"parallel": {"pp": 2}, "precision": "fp16-mixed"}, "use 'bf16-mixed'"),
    ({"parallel": {"tp": 2}, "precision": "fp16-mixed"}, "use 'bf16-mixed'"),
    ({"parallel": {"tp": 2}, "compression": "powersgd"}, "does not use: unset them"),
    ({"parallel": {"tp": 2}, "ddp": {"static_graph": True}}, "does not use: unset them"),
])
def test_config_rejects_what_model_parallelism_cannot_do(settings, expected):
    assert expected in _error(lambda: shoal.TrainerConfig.build(**settings))
