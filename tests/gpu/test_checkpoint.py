"""Checkpoints saved on the GPU, synchronously or in the background, resume exactly: 5 steps,
then from the checkpoint of step 4 on to step 9, end bit for bit where 9 steps straight end.

Two models: the reference MLP under ddp (plain tensors, SGD momentum) and the GPT under fsdp
(sharded DTensors, AdamW). Deterministic kernels make two runs of the same steps equal, so
any difference is the checkpoint's. Under NCCL an asynchronous save coordinates its ranks
over a gloo side group (NCCL has no CPU side) and stages the tensors in pinned memory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

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
    same,
    tokens,
    whole_weights,
)
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer

SETUPS = ("ddp", "fsdp")
MODES = {"sync": False, "async": True}


def _trainer(setup: str, **settings) -> shoal.Trainer:
    if setup == "ddp":
        model = make_model()
        return shoal.Trainer(model, make_optimizer(model), batch_size=8, seed=SEED,
                             backend=BACKEND, progress=False, **settings)
    model = make_gpt()
    return shoal.Trainer(model, adamw(model), loss_fn=gpt.loss, strategy="fsdp",
                         batch_size=8, seed=GPT["seed"], backend=BACKEND, progress=False,
                         **settings)


def _data(setup: str) -> torch.utils.data.Dataset:
    return make_dataset() if setup == "ddp" else tokens()


def _resumed(setup: str, directory: Path, background: bool) -> dict:
    """5 steps saving every 2 (and at the end), then 9 from step 4's checkpoint."""
    first = _trainer(setup, checkpoint_dir=str(directory), checkpoint_every=2,
                     async_checkpoint=background, keep_last=10)
    first.fit(_data(setup), max_steps=5)
    names = sorted(p.name for p in directory.iterdir())
    group = first.checkpointing.store._cpu_group
    # Step 4's checkpoint was (in the background) saved while step 5 changed the weights.
    shutil.rmtree(directory / "step_000000005")
    resumed = _trainer(setup, checkpoint_dir=str(directory), resume="auto",
                       async_checkpoint=background)
    # Nine steps from scratch would end as the straight run too: count the steps taken.
    taken: list[int] = []
    resumed.optimizer.register_step_post_hook(lambda *_: taken.append(1))
    resumed.fit(_data(setup), max_steps=9)
    return {"names": names, "weights": whole_weights(resumed), "taken": len(taken),
            "side_group": torch.distributed.get_backend(group) if group else None,
            "device": device_of(resumed)}


def _worker(root: str) -> dict:
    deterministic()
    init()
    results = {}
    for setup in SETUPS:
        straight = _trainer(setup)
        straight.fit(_data(setup), max_steps=9)
        results[setup] = {"straight": whole_weights(straight), **{
            mode: _resumed(setup, Path(root) / f"{setup}-{mode}", background)
            for mode, background in MODES.items()}}
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return shoal.spawn(_worker, nprocs=1, args=(str(tmp_path_factory.mktemp("ckpt")),))[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", SETUPS)
def test_resume_from_a_gpu_checkpoint_is_exact(results, setup, mode):
    run = results[setup][mode]
    assert run["names"] == ["step_000000002", "step_000000004", "step_000000005"]
    assert run["device"] == DEVICE
    assert run["taken"] == 5, f"resumed at step {9 - run['taken']}, not from step 4"
    assert same(run["weights"], results[setup]["straight"]), f"{setup}, {mode}: not exact"
    initial = (make_model() if setup == "ddp" else make_gpt()).state_dict()
    assert not same(run["weights"], initial), "no training happened"


def test_async_saves_under_nccl_use_a_gloo_side_group(results):
    for setup in SETUPS:
        assert results[setup]["async"]["side_group"] == "gloo", setup
        assert results[setup]["sync"]["side_group"] is None, setup
