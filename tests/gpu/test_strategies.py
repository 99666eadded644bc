"""On the GPU, zero1, zero2 and fsdp at one process train the small GPT as ddp does, and a
GPT built on the meta device trains bit for bit as the one built whole.

Both run with deterministic kernels and without TF32, so that what differs between two runs
is the strategy, not the GPU's choice of kernel or the order of its atomic adds.
- Strategies against ddp: losses within 1e-5 relative, weights within 1e-4 of each
  tensor's largest entry (tests/parallel/test_sharded.py's bounds for reordered sums; at
  one process the shards are whole, so they are upper bounds).
- Meta against whole: the initial weights are drawn on the CPU from generators seeded by
  name, so they are equal bit for bit, and so is the training that follows.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import DTensor

import shoal
from shoal.examples import gpt
from tests.gpu.common import (
    BACKEND,
    DEVICE,
    GPT,
    adamw,
    deterministic,
    device_of,
    init,
    make_gpt,
    recording,
    same,
    tokens,
    whole_weights,
)
from tests.helpers import max_rel_diff
from tests.parallel.test_sharded import NO_GRADIENT

BATCH, STEPS, CLIP = 8, 5, 0.5
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 1e-4
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
META_RUNS = {"ddp": {}, "fsdp": {"strategy": "fsdp"}}


def _train(strategy: str) -> dict:
    model = make_gpt()
    losses: list[float] = []
    trainer = shoal.Trainer(model, adamw(model), loss_fn=recording(losses),
                            strategy=strategy, batch_size=BATCH, clip_grad_norm=CLIP,
                            seed=GPT["seed"], backend=BACKEND, progress=False)
    trainer.fit(tokens(), max_steps=STEPS)
    return {"losses": losses, "weights": whole_weights(trainer), "device": device_of(trainer),
            "sharded_parameters": isinstance(next(trainer.model.parameters()), DTensor),
            # By name: importing torch.distributed.optim here warns about TorchScript.
            "sharded_optimizer": type(trainer.optimizer).__name__ == "ZeroRedundancyOptimizer"}


def _from(device: str, settings: dict) -> dict:
    """Built on ``device`` ('cpu': whole, 'meta': no storage until the strategy places it),
    trained two steps: the whole weights before and after."""
    model = make_gpt(device)
    trainer = shoal.Trainer(model, adamw(model), loss_fn=gpt.loss, batch_size=BATCH,
                            seed=GPT["seed"], backend=BACKEND, progress=False, **settings)
    start = whole_weights(trainer)
    trainer.fit(tokens(), max_steps=2)
    return {"start": start, "end": whole_weights(trainer), "device": device_of(trainer)}


def _worker() -> dict:
    deterministic()
    init()
    return {"strategies": {name: _train(name) for name in STRATEGIES},
            "meta": {name: {device: _from(device, settings) for device in ("cpu", "meta")}
                     for name, settings in META_RUNS.items()}}


@pytest.fixture(scope="module")
def results() -> dict:
    return shoal.spawn(_worker, nprocs=1)[0]


@pytest.mark.parametrize("name", STRATEGIES[1:])
def test_sharded_strategy_matches_ddp(results, name):
    runs = results["strategies"]
    run, ddp = runs[name], runs["ddp"]
    assert run["device"] == ddp["device"] == DEVICE
    # What makes each strategy itself: zero1 shards the optimizer, zero2 and fsdp the
    # parameters (DTensors), ddp neither.
    assert run["sharded_optimizer"] == (name == "zero1"), name
    assert run["sharded_parameters"] == (name in ("zero2", "fsdp")), name
    assert not (ddp["sharded_optimizer"] or ddp["sharded_parameters"])
    assert len(run["losses"]) == len(ddp["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(run["losses"], ddp["losses"], strict=True)):
        assert abs(got - want) <= LOSS_TOLERANCE * abs(want), (name, step, got, want)
    # The key bias has no gradient in exact arithmetic: AdamW turns its rounding noise into
    # steps of size lr (see test_sharded), so it is left out.
    weights = {k: v for k, v in run["weights"].items() if not k.endswith(NO_GRADIENT)}
    diff = max_rel_diff(weights, {k: ddp["weights"][k] for k in weights})
    assert diff <= WEIGHT_TOLERANCE, f"{name}: weights differ from ddp's by {diff:.2e}"
    assert not same(ddp["weights"], make_gpt().state_dict()), "no training happened"


@pytest.mark.parametrize("name", META_RUNS)
def test_meta_model_trains_as_the_whole_one(results, name):
    built, meta = results["meta"][name]["cpu"], results["meta"][name]["meta"]
    assert built["device"] == meta["device"] == DEVICE
    assert same(meta["start"], make_gpt().state_dict()), "meta: not the whole initial weights"
    assert same(meta["end"], built["end"]), f"{name}: trained differently"
    assert not same(meta["end"], meta["start"]), "no training happened"
