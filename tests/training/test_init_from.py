"""`trainer.init_from`: a new run starts from weights out of a file (`shoal export`'s
safetensors or torch), a Hugging Face-style directory or a shoal checkpoint: the model
holds them to the bit at its first step, under ddp in one process and fsdp on two (each
rank its shard), with a fresh optimizer at step 0; what does not fit is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import shoal
from shoal.checkpoint.export import export
from shoal.errors import UsageError
from tests.helpers import states_equal
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer


class AtStart(shoal.Callback):
    """The whole model's weights, the step and the optimizer's state as the first step
    finds them."""

    def on_fit_start(self, trainer):
        self.weights = {k: v.clone() for k, v in get_model_state_dict(
            trainer.model, options=StateDictOptions(full_state_dict=True)).items()}
        self.step, self.optimizer_state = trainer.global_step, dict(trainer.optimizer.state)


def _trainer(callbacks=(), **settings) -> shoal.Trainer:
    model = make_model()
    settings = {"batch_size": 16, **settings}
    return shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                         callbacks=list(callbacks), **settings)


def _trained(tmp_path) -> dict[str, torch.Tensor]:
    """Weights after 3 steps (not make_model's), checkpointed in tmp_path/ck; and exported."""
    trainer = _trainer(checkpoint_dir=str(tmp_path / "ck"))
    trainer.fit(make_dataset(), max_steps=3)
    export(tmp_path / "ck", tmp_path / "model.safetensors")
    export(tmp_path / "ck", tmp_path / "model.pt", "torch")
    (tmp_path / "hf").mkdir()  # a save_pretrained directory's weights file
    (tmp_path / "hf" / "model.safetensors").write_bytes((tmp_path / "model.safetensors")
                                                        .read_bytes())
    return {k: v.clone() for k, v in trainer.module.state_dict().items()}


@pytest.mark.parametrize("source", ["model.safetensors", "model.pt", "hf", "ck"])
def test_a_new_run_starts_from_the_weights(single_process, tmp_path, source):
    trained = _trained(tmp_path)
    seen = AtStart()
    _trainer([seen], init_from=str(tmp_path / source)).fit(make_dataset(), max_steps=1)
    assert states_equal(seen.weights, trained)
    assert seen.step == 0 and seen.optimizer_state == {}
    assert not states_equal(trained, make_model().state_dict())  # (it trained)


def _fsdp_start(root: str) -> dict:
    shoal.init("gloo")
    seen = AtStart()
    _trainer([seen], strategy="fsdp", batch_size=8,
             init_from=f"{root}/model.safetensors").fit(make_dataset(), max_steps=1)
    return {k: v.clone() for k, v in seen.weights.items()}


def test_under_fsdp_each_rank_takes_its_shard(tmp_path):
    shoal.spawn(_trained_at_one, nprocs=1, args=(str(tmp_path),))
    trained = torch.load(tmp_path / "model.pt", weights_only=True)
    for weights in shoal.spawn(_fsdp_start, nprocs=2, args=(str(tmp_path),)):
        assert states_equal(weights, trained)


def _trained_at_one(root: str) -> None:
    shoal.init("gloo")
    _trained(Path(root))


def test_weights_that_do_not_fit_are_one_line(single_process, tmp_path):
    torch.save({"0.weight": torch.zeros(16, 10)}, tmp_path / "partial.pt")
    with pytest.raises(UsageError, match=r"^init_from .*partial.pt: no weights for 0.bias, "
                                         r"2.weight, 2.bias \(it has 0.weight\)$"):
        _trainer(init_from=str(tmp_path / "partial.pt")).fit(make_dataset(), max_steps=1)
    torch.save({**make_model().state_dict(), "0.weight": torch.zeros(3, 3)},
               tmp_path / "shape.pt")
    with pytest.raises(UsageError, match=r"0.weight has shape \(3, 3\), the model's is "
                                         r"\(16, 10\)"):
        _trainer(init_from=str(tmp_path / "shape.pt")).fit(make_dataset(), max_steps=1)
    with pytest.raises(UsageError, match="init_from: .*nowhere: no such file or directory"):
        _trainer(init_from=str(tmp_path / "nowhere"))
