"""The checkpoint store: round trip, atomic commit, corruption found and skipped, no pickle."""

from __future__ import annotations

import os

import pytest
import torch

import shoal
from shoal.checkpoint import CheckpointError, CheckpointStore, tree
from tests.training.reference import make_dataset, make_model, make_optimizer


def _state(step: int) -> dict:
    model = make_model()
    for p in model.parameters():
        p.data.fill_(float(step))
    return {"model": model.state_dict(), "counters": {"step": step, "lr": (0.1, None)},
            "big": torch.arange(4096.0)}  # a shard large enough to truncate


@pytest.fixture
def store(tmp_path, single_process):
    store = CheckpointStore(tmp_path / "ckpt", keep_last=5)
    for step in (10, 20, 30):
        store.save(step, _state(step), {"own": torch.tensor([step])}, {"epoch": step // 10})
    return store


def test_round_trip_and_keep_last(store, tmp_path):
    shared, own, meta = store.load(store.latest())
    expected = _state(30)
    assert all(torch.equal(shared["model"][k], expected["model"][k]) for k in expected["model"])
    assert shared["counters"] == {"step": 30, "lr": (0.1, None)}
    assert torch.equal(own["own"], torch.tensor([30]))
    assert meta == {"epoch": 3, "world_size": 1, "step": 30}
    store.keep_last = 2
    store.save(40, _state(40), {}, {})
    assert [p.name for p in store._step_dirs()] == ["step_000000030", "step_000000040"]


def test_a_live_groups_own_part_of_a_step_is_kept_and_pruned_with_it(store):
    """A live group that does not write the checkpoints keeps its ranks' own part of a step
    beside it (whole or not at all); a step pruned takes its groups' parts along, and so
    does an older step that never committed."""
    for step in (20, 30, 35):  # (35: never committed)
        store.save_own(step, 1, {"comm": {"state": torch.tensor([step, 1])}})
    found = store.load_own(store.latest(), 1)
    assert torch.equal(found["comm"]["state"], torch.tensor([30, 1]))
    assert store.load_own(store.latest(), 2) is None
    assert not list(store.own_path(30, 1).glob("*.partial"))
    store.keep_last = 1
    store.save(40, _state(40), {}, {})
    assert sorted(p.name for p in store.root.iterdir()) == ["step_000000040"]


def test_skipped_tensors_are_not_read(store):
    # A pipeline stage skips the other stages' tensors: they come back as None.
    shared, own, _ = store.load(store.latest(), skip=lambda key: key.startswith("shared.model."))
    assert shared["model"] and all(v is None for v in shared["model"].values())
    assert torch.equal(shared["big"], torch.arange(4096.0))
    assert torch.equal(own["own"], torch.tensor([30]))


def _newest_shard(store) -> object:
    return max((store.root / "step_000000030").glob("*.distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage, message", [
    ("truncate", "bytes, "),
    ("delete", "is missing"),
    ("unmark", "no commit marker"),
])
def test_broken_checkpoint_is_named_and_the_previous_one_used(store, capsys, damage, message):
    shard = _newest_shard(store)
    if damage == "truncate":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        shard.unlink()
    else:
        (store.root / "step_000000030" / "COMMIT.json").unlink()
    assert store.latest().name == "step_000000020"
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step_000000030" in err and message in err
    with pytest.raises(CheckpointError, match=message):
        store.load(store.root / "step_000000030")
    shared, _, meta = store.load(store.latest())
    assert meta["step"] == 20 and shared["counters"]["step"] == 20


def test_crash_mid_save_leaves_no_complete_checkpoint(store):
    # What a crash between the shards and the commit leaves: a .partial folder.
    (store.root / "step_000000040.partial").mkdir()
    assert store.latest().name == "step_000000030"


@pytest.mark.parametrize("moment", ["its commit marker", "its rename"])
def test_two_writers_of_one_step_keep_the_first_commit(tmp_path, single_process, monkeypatch,
                                                       moment):
    """Two live replica groups stopped while they wait for each other save the same step
    at once: each writes its own partial directory, and the one that commits second (here
    group 0: group 1 commits just before group 0 writes its commit marker, or renames its
    directory) keeps the first commit. A step committed before the save began is replaced
    (a step saved again)."""
    first = CheckpointStore(tmp_path / "ckpt", writer="group0")
    second = CheckpointStore(tmp_path / "ckpt", writer="group1")
    first.save(7, _state(7), {}, {"by": "before"})
    second.save(7, _state(7), {}, {"by": "again"})
    assert first.load(first.latest())[2]["by"] == "again"
    rename = os.replace
    at = ".partial.group0" if moment == "its rename" else "COMMIT.tmp"

    def the_other_commits_first(source, target):
        if str(source).endswith(at):
            monkeypatch.setattr(os, "replace", rename)
            second.save(7, _state(7), {}, {"by": 1})
        rename(source, target)

    monkeypatch.setattr(os, "replace", the_other_commits_first)
    first.save(7, _state(7), {}, {"by": 0})
    assert [p.name for p in first.root.iterdir()] == ["step_000000007"]
    _, _, meta = first.load(first.latest())
    assert meta["by"] == 1


def test_model_that_does_not_fit_lists_the_keys(tmp_path, single_process):
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), progress=False,
                            checkpoint_dir=str(tmp_path), checkpoint_every=2)
    trainer.fit(make_dataset(), max_steps=2)
    _, _, meta = trainer.checkpointing.store.load(trainer.checkpointing.store.latest())
    assert meta["trainer_config"]["checkpoint_every"] == 2 and meta["global_step"] == 2
    other = torch.nn.Sequential(torch.nn.Linear(10, 17), torch.nn.Tanh(),
                                torch.nn.Linear(17, 3), torch.nn.Linear(3, 3))
    again = shoal.Trainer(other, make_optimizer(other), progress=False,
                          checkpoint_dir=str(tmp_path), resume="auto")
    with pytest.raises(CheckpointError) as info:
        again.fit(make_dataset(), max_steps=4)
    text = str(info.value)
    assert "not in checkpoint: 3.bias, 3.weight" in text
    assert "0.weight (checkpoint [16, 10], model [17, 10])" in text


def test_nothing_is_unpickled(store, monkeypatch):
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)
    monkeypatch.setattr(torch, "load", spy)
    store.load(store.latest())
    assert False not in calls  # DCP reads tensors with weights_only=True; no object is read


def test_objects_that_would_need_pickle_are_refused():
    with pytest.raises(TypeError, match="without pickling"):
        tree.split({"fn": print}, "x")
    skeleton, tensors = tree.split({"a": (1, [2.5, float("nan")]), 3: torch.ones(2)}, "p")
    back = tree.join(skeleton, tensors)
    assert back["a"][0] == 1 and back["a"][1][0] == 2.5 and back["a"][1][1] != back["a"][1][1]
    assert torch.equal(back[3], torch.ones(2))


def test_resume_that_cannot_keep_the_global_batch_says_what_to_change(tmp_path,
                                                                      single_process):
    from shoal.errors import UsageError

    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), progress=False, batch_size=8,
                            accumulate_grad_batches=3, checkpoint_dir=str(tmp_path),
                            checkpoint_every=2)
    trainer.fit(make_dataset(), max_steps=2)   # global batch 24
    model = make_model()
    again = shoal.Trainer(model, make_optimizer(model), progress=False, batch_size=5,
                          checkpoint_dir=str(tmp_path), resume="auto")
    with pytest.raises(UsageError, match="global batch is 24 samples.*batch_size"):
        again.fit(make_dataset(), max_steps=4)
