"""A checkpoint saved under one strategy and world size continues under another: fsdp or
zero1 at W=2 to ddp at W=1 and the reverse; a pipeline (pp=2) to one process, one process
to tensor parallelism (tp=2). Loaded, the model and optimizer are exactly the saver's;
trained on, the run reaches the weights of one uninterrupted process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils._pytree import tree_map_only

import shoal
from shoal.checkpoint import CheckpointStore
from shoal.examples import gpt
from shoal.parallel.zero import gather_optimizer_state, is_zero
from tests.helpers import max_rel_diff, run_shoal_in_process, states_equal
from tests.parallel.test_sharded import (
    CLIP,
    NO_GRADIENT,
    SEED,
    WEIGHT_TOLERANCE,
    make_dataset,
    make_model,
    make_optimizer,
    reference,
)

GLOBAL_BATCH, SAVED_AT, STEPS = 16, 3, 6  # 4 steps an epoch: saved mid-epoch


def _full_state(trainer: shoal.Trainer) -> dict:
    """Whole model and optimizer state, keyed by name, on every rank (copies: training
    goes on in place)."""
    options = StateDictOptions(full_state_dict=True)
    if is_zero(trainer.optimizer):
        model, _ = get_state_dict(trainer.model, [], options=options)
        optimizer = gather_optimizer_state(trainer.model, trainer.optimizer)
    else:  # a pipeline stage: its part only
        model, optimizer = get_state_dict(trainer.state_model, trainer.optimizer,
                                          options=options)
    return tree_map_only(torch.Tensor, torch.clone, {"model": model, "optimizer": optimizer})


def _trainer(strategy: str, directory: Path, resume: str | None = None,
             parallel: dict | None = None) -> shoal.Trainer:
    model = make_model()
    split = (parallel or {}).get("tp", 1) * (parallel or {}).get("pp", 1)
    batch = GLOBAL_BATCH // (shoal.world_size() // split)
    return shoal.Trainer(model, make_optimizer(model), loss_fn=gpt.loss, strategy=strategy,
                         batch_size=batch, seed=SEED, clip_grad_norm=CLIP, progress=False,
                         checkpoint_dir=str(directory), resume=resume,
                         parallel=parallel or {})


def _save(strategy: str, directory: Path, parallel: dict | None = None) -> dict:
    """Train SAVED_AT steps from scratch; the checkpoint is written at the end of fit."""
    trainer = _trainer(strategy, directory, parallel=parallel)
    trainer.fit(make_dataset(), max_steps=SAVED_AT)
    return _full_state(trainer)


def _resume(strategy: str, source: Path, directory: Path, parallel: dict | None = None
            ) -> dict:
    """Load ``source`` (what it holds, as loaded), then train on to STEPS."""
    checkpoint = str(CheckpointStore(source).latest())
    trainer = _trainer(strategy, directory, resume=checkpoint, parallel=parallel)
    trainer.fit(make_dataset(), max_steps=SAVED_AT)  # loads, and has nothing left to do
    loaded = _full_state(trainer)
    trainer.fit(make_dataset(), max_steps=STEPS)
    return {"loaded": loaded, "step": trainer.global_step,
            "final": _full_state(trainer)["model"]}


def _one_process(root: str) -> dict:
    shoal.init("gloo")
    root_path = Path(root)
    return {"from_fsdp": _resume("ddp", root_path / "fsdp", root_path / "ddp_from_fsdp"),
            "from_zero1": _resume("ddp", root_path / "zero1", root_path / "ddp_from_zero1"),
            "from_pp": _resume("ddp", root_path / "pp", root_path / "ddp_from_pp")}


def _two_processes(root: str) -> dict:
    shoal.init("gloo")
    root_path = Path(root)
    return {"fsdp_saved": _save("fsdp", root_path / "fsdp"),
            "zero1_saved": _save("zero1", root_path / "zero1"),
            "fsdp_from_ddp": _resume("fsdp", root_path / "ddp_w1", root_path / "fsdp_from_ddp"),
            "zero1_from_ddp": _resume("zero1", root_path / "ddp_w1",
                                      root_path / "zero1_from_ddp"),
            "pp_saved": _save("ddp", root_path / "pp", parallel={"pp": 2}),
            "tp_from_ddp": _resume("ddp", root_path / "ddp_w1", root_path / "tp_from_ddp",
                                   parallel={"tp": 2}),
            "pp_from_ddp": _resume("ddp", root_path / "ddp_w1", root_path / "pp_from_ddp",
                                   parallel={"pp": 2})}


def _save_at_one(root: str) -> dict:
    shoal.init("gloo")
    return _save("ddp", Path(root) / "ddp_w1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("cross"))
    ddp_w1 = shoal.spawn(_save_at_one, nprocs=1, args=(root,))[0]
    two = shoal.spawn(_two_processes, nprocs=2, args=(root,))
    one = shoal.spawn(_one_process, nprocs=1, args=(root,))[0]
    return {"ddp_w1": ddp_w1, "two": two, "one": one, "root": Path(root)}


def _continues_like_one_process(result: dict, label: str) -> None:
    assert result["step"] == STEPS, label
    expected = reference(steps=STEPS, global_batch=GLOBAL_BATCH)["weights"]
    weights = {k: v for k, v in result["final"].items() if not k.endswith(NO_GRADIENT)}
    diff = max_rel_diff(weights, {k: expected[k] for k in weights})
    assert diff <= WEIGHT_TOLERANCE, f"{label}: {diff:.2e} from one uninterrupted process"


@pytest.mark.parametrize("saver", ["fsdp", "zero1"])
def test_saved_at_two_loads_at_one(runs, saver):
    saved = runs["two"][0][f"{saver}_saved"]
    resumed = runs["one"][f"from_{saver}"]
    assert states_equal(resumed["loaded"]["model"], saved["model"])
    assert states_equal(resumed["loaded"]["optimizer"], saved["optimizer"])
    _continues_like_one_process(resumed, f"{saver} W=2 -> ddp W=1")


@pytest.mark.parametrize("loader", ["fsdp", "zero1"])
def test_saved_at_one_loads_at_two(runs, loader):
    saved = runs["ddp_w1"]
    for rank, result in enumerate(runs["two"]):
        resumed = result[f"{loader}_from_ddp"]
        assert states_equal(resumed["loaded"]["model"], saved["model"]), rank
        assert states_equal(resumed["loaded"]["optimizer"], saved["optimizer"]), rank
        _continues_like_one_process(resumed, f"ddp W=1 -> {loader} W=2, rank {rank}")


def test_pipeline_checkpoint_loads_in_one_process(runs):
    # Each stage saved its part under the whole model's names: together, the whole state.
    stages = [result["pp_saved"] for result in runs["two"]]
    saved_model = {k: v for stage in stages for k, v in stage["model"].items()}
    saved_state = {k: v for stage in stages for k, v in stage["optimizer"]["state"].items()}
    resumed = runs["one"]["from_pp"]
    assert states_equal(resumed["loaded"]["model"], saved_model)
    assert states_equal(resumed["loaded"]["optimizer"]["state"], saved_state)
    _continues_like_one_process(resumed, "pp=2 -> one process")


def test_one_process_checkpoint_loads_into_a_pipeline(runs):
    saved = runs["ddp_w1"]
    stages = [result["pp_from_ddp"] for result in runs["two"]]
    loaded = {k: v for stage in stages for k, v in stage["loaded"]["model"].items()}
    state = {k: v for stage in stages for k, v in stage["loaded"]["optimizer"]["state"].items()}
    assert states_equal(loaded, saved["model"])
    assert states_equal(state, saved["optimizer"]["state"])
    final = {k: v for stage in stages for k, v in stage["final"].items()}
    _continues_like_one_process({"step": stages[0]["step"], "final": final},
                                "one process -> pp=2")


def test_one_process_checkpoint_loads_under_tensor_parallel(runs):
    saved = runs["ddp_w1"]
    for rank, result in enumerate(runs["two"]):
        resumed = result["tp_from_ddp"]
        assert states_equal(resumed["loaded"]["model"], saved["model"]), rank
        assert states_equal(resumed["loaded"]["optimizer"], saved["optimizer"]), rank
        _continues_like_one_process(resumed, f"one process -> tp=2, rank {rank}")


def test_checkpoint_numbered_by_an_older_shoal_still_loads(single_process, tmp_path,
                                                           monkeypatch):
    import shoal.training.state as state

    # Before name-keyed checkpoints, the optimizer's own state_dict (numbered) was saved.
    monkeypatch.setattr(state, "model_and_optimizer_state",
                        lambda model, optimizer: (model.module.state_dict(),
                                                  optimizer.state_dict()))
    old = _trainer("ddp", tmp_path)
    old.fit(make_dataset(), max_steps=2)
    monkeypatch.undo()
    resumed = _trainer("ddp", tmp_path, resume="auto")
    resumed.fit(make_dataset(), max_steps=2)  # loads; nothing left to do
    assert states_equal(resumed.optimizer.state_dict(), old.optimizer.state_dict())
    assert states_equal(resumed.module.state_dict(), old.module.state_dict())


@pytest.mark.parametrize("saver", ["ddp_w1", "fsdp", "zero1", "pp", "tp_from_ddp"])
@pytest.mark.parametrize("format", ["safetensors", "torch"])
def test_any_strategys_checkpoint_exports_to_one_file_of_the_trained_weights(
        runs, saver, format, tmp_path):
    """`shoal export` of each strategy's checkpoint (fsdp and tp: sharded tensors; pp: each
    stage's part), in one process: the whole model, keyed as its state_dict, bitwise the
    weights the run held; loaded by safetensors or torch alone."""
    out = tmp_path / f"model.{format}"
    result = run_shoal_in_process("export", str(runs["root"] / saver), str(out),
                                  "--format", format)
    assert result.returncode == 0, result.stderr
    if format == "safetensors":
        from safetensors.torch import load_file

        exported = load_file(str(out))
    else:
        exported = torch.load(out, weights_only=True)
    if saver == "ddp_w1":
        trained = runs["ddp_w1"]["model"]
    elif saver == "pp":  # each stage's part, under the whole model's names
        trained = {k: v for r in runs["two"] for k, v in r["pp_saved"]["model"].items()}
    elif saver == "tp_from_ddp":
        trained = runs["two"][0]["tp_from_ddp"]["final"]
    else:
        trained = runs["two"][0][f"{saver}_saved"]["model"]
    assert states_equal(exported, trained)
