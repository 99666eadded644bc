"""A GPT built on the meta device gets, on every rank, exactly the initial weights of the one
built whole, whatever the strategy or split; trained, it stays bit for bit the same run."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import shoal
from shoal.errors import UsageError
from shoal.examples import gpt
from tests.parallel.test_sharded import SEED, make_dataset, make_optimizer

MODEL = dict(vocab_size=33, seq_len=8, n_layer=2, n_head=2, d_model=16, seed=SEED)
RUNS = {
    "ddp": {},
    "fsdp": {"strategy": "fsdp"},
    "tp": {"parallel": {"tp": 2}},
    "pp": {"parallel": {"pp": 2}, "pipeline": {"microbatches": 2}},
}


def _whole(trainer: shoal.Trainer) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(trainer.state_model,
                                 options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _run(settings: dict, device: str) -> dict:
    model = gpt.build_model(**MODEL, device=device)
    trainer = shoal.Trainer(model, make_optimizer(model), loss_fn=gpt.loss, batch_size=8,
                            seed=SEED, progress=False, clip_grad_norm=0.5, **settings)
    start = _whole(trainer)
    trainer.fit(make_dataset(), max_steps=2)
    return {"start": start, "end": _whole(trainer)}


def _worker() -> dict:
    shoal.init("gloo")
    results = {name: {device: _run(settings, device) for device in ("cpu", "meta")}
               for name, settings in RUNS.items()}

    class NoInit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    with torch.device("meta"):
        bare = NoInit()
    try:
        shoal.Trainer(bare, torch.optim.SGD(bare.parameters(), lr=0.1), progress=False)
    except UsageError as error:
        results["refused"] = str(error)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return shoal.spawn(_worker, nprocs=2)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", RUNS)
def test_meta_model_starts_and_trains_as_the_whole_one(results, name):
    whole = gpt.build_model(**MODEL).state_dict()
    for result in results:
        built, meta = result[name]["cpu"], result[name]["meta"]
        # A stage holds its part of the whole model's weights.
        assert meta["start"] and _same(meta["start"], {k: whole[k] for k in meta["start"]})
        assert _same(meta["end"], built["end"]), name
        assert not _same(meta["end"], meta["start"]), "no training happened"


def test_a_meta_model_without_an_init_is_refused(results):
    assert all("has no init_parameter(name, tensor)" in r["refused"] for r in results)
