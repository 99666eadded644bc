"""Batches of any structure: pairs, mappings, dataclasses, tuples and nested ones are moved
whole, counted, and give the same training as (inputs, targets) with cross-entropy, whether
the loss comes from loss_fn(outputs, batch), step_fn(model, batch) or the model itself."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

import shoal
from shoal.errors import UsageError
from shoal.training.batches import move_to_device, samples_in, tokens_in
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer

BATCH, STEPS = 16, 6


@dataclasses.dataclass
class Example:
    x: torch.Tensor
    y: torch.Tensor


class Pair(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor


class Shaped(Dataset):
    """The reference samples, each reshaped by ``shape``."""

    def __init__(self, shape):
        self.data, self.shape = make_dataset(), shape

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.shape(*self.data[i])


class ReturnsLoss(nn.Module):
    """The reference model, returning its loss in a dict as a transformers model does."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x, y=None):
        logits = self.net(x)
        return {"logits": logits, "loss": None if y is None else F.cross_entropy(logits, y)}


def _train(shape, model=None, **losses) -> dict[str, torch.Tensor]:
    model = model or make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=BATCH, seed=SEED,
                            progress=False, **losses)
    trainer.fit(shape if isinstance(shape, DataLoader) else Shaped(shape), max_steps=STEPS)
    return {k.removeprefix("net."): v.detach().clone()
            for k, v in trainer.module.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_structure_trains_as_pairs_do(single_process):
    pairs = _train(lambda x, y: (x, y))
    runs = {
        "namedtuple": _train(Pair),
        "dict, the model's loss": _train(lambda x, y: {"x": x, "y": y}, ReturnsLoss()),
        # torch's default collate makes no dataclass: a DataLoader's own collate_fn does.
        "dataclass, the model's loss": _train(
            DataLoader(make_dataset(), batch_size=BATCH, shuffle=True,
                       collate_fn=lambda samples: Example(*default_collate(samples))),
            ReturnsLoss()),
        "dict, loss_fn(outputs, batch)": _train(
            lambda x, y: {"x": x, "y": y}, ReturnsLoss(),
            loss_fn=lambda outputs, batch: F.cross_entropy(outputs["logits"], batch["y"])),
        "nested, step_fn(model, batch)": _train(
            lambda x, y: {"features": [x], "labels": {"class": y}},
            step_fn=lambda model, batch: F.cross_entropy(model(batch["features"][0]),
                                                         batch["labels"]["class"])),
    }
    for name, weights in runs.items():
        assert _same(weights, pairs), name


def test_validation_of_a_model_that_returns_its_loss(single_process):
    model = ReturnsLoss()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=7, progress=False)
    got = trainer.validate(Shaped(lambda x, y: {"x": x, "y": y}))
    x, y = make_dataset().tensors
    with torch.no_grad():
        expected = F.cross_entropy(model.net(x), y).item()
    assert got == {"val_loss": pytest.approx(expected, rel=1e-6)}


def test_moved_whole_with_their_types():
    batch = {"pair": Pair(torch.ones(3, 2), torch.zeros(3)), "list": [torch.ones(3)],
             "example": Example(torch.ones(3, 4), torch.zeros(3)), "name": "kept"}
    moved = move_to_device(batch, torch.device("meta"))
    assert isinstance(moved["pair"], Pair) and isinstance(moved["example"], Example)
    assert moved["pair"].inputs.is_meta and moved["list"][0].is_meta and moved["example"].x.is_meta
    assert moved["name"] == "kept"
    assert samples_in(batch) == 3


def test_counted():
    ids = torch.zeros(4, 10, dtype=torch.long)
    assert (samples_in((ids, ids)), tokens_in((ids, ids))) == (4, 40)
    assert (samples_in({"input_ids": ids}), tokens_in({"input_ids": ids})) == (4, 40)
    assert tokens_in(Example(torch.zeros(4, 3), torch.zeros(4))) == 0  # features, not ids


@pytest.mark.parametrize("losses, message", [
    ({"loss_fn": lambda outputs: outputs}, "loss_fn must take two arguments (outputs, batch)"),
    ({"step_fn": lambda model, batch, extra: 0}, "step_fn must take two arguments (model, batch)"),
    ({"loss_fn": F.cross_entropy, "step_fn": lambda model, batch: 0}, "not both"),
    ({"loss_fn": "cross_entropy"}, "loss_fn must be a function"),
])
def test_loss_functions_are_checked_when_built(single_process, losses, message):
    model = make_model()
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        shoal.Trainer(model, make_optimizer(model), progress=False, **losses)


def test_a_model_without_a_loss_is_named(single_process):
    model = ReturnsLoss()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=BATCH, progress=False)
    with pytest.raises(UsageError, match="the model returned dict without a 'loss'"):
        trainer.fit(Shaped(lambda x, y: {"x": x}), max_steps=1)


@pytest.mark.parametrize("pipeline, says", [
    ({"microbatch": 4}, "pipeline.microbatch: unknown key"),
    ({"microbatches": 0}, "pipeline.microbatches"),
])
def test_a_bad_pipeline_setting_of_the_harness_is_one_line(pipeline, says):
    from shoal.training.harness import Harness

    with pytest.raises(UsageError, match=says):
        Harness(pipeline=pipeline)
