"""Callbacks: called at the loop's points on every rank, observers that change nothing (the
run with them ends bitwise equal to the run without), a stop every rank takes after the
same step, early stopping that chooses the same step after a SIGKILL and a resume, and
callbacks named by import path in a run config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import shoal
from shoal.training.callbacks import HOOKS
from tests.ft.runs import TIMEOUT, start_piped
from tests.helpers import run_shoal, states_equal
from tests.training.reference import SEED, make_dataset, make_model, make_optimizer

JOB = str(Path(__file__).with_name("callbacks_job.py"))


class Seen(shoal.Callback):
    def __init__(self):
        self.seen: list[tuple[str, int]] = []


for _hook in HOOKS:
    def _log(self, trainer, *args, _name=_hook):
        self.seen.append((_name, trainer.global_step))
    setattr(Seen, _hook, _log)


def test_the_hooks_come_at_the_loops_points(single_process, tmp_path):
    """Two epochs of 5 steps, a validation every 2 steps and at each epoch's end, a
    checkpoint every 4: each hook at its step, in the loop's order."""
    model, seen = make_model(), Seen()
    trainer = shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                            batch_size=48, val_every_steps=2, checkpoint_dir=str(tmp_path),
                            checkpoint_every=4, callbacks=[seen])
    trainer.fit(make_dataset(), make_dataset(48), epochs=2)
    steps = [("on_step_end", s) for s in range(1, 11)]
    validations = {s: [("on_validation_end", s)] for s in (2, 4, 5, 6, 8, 10)}
    saves = {s: [("on_save_checkpoint", s), ("on_checkpoint_saved", s)] for s in (4, 8)}
    expected = [("on_fit_start", 0), ("on_epoch_start", 0)]
    for step in steps:
        expected += [step, *validations.get(step[1], []), *saves.get(step[1], [])]
        if step[1] == 5:
            expected += [("on_epoch_end", 5), ("on_epoch_start", 5)]
    expected += [("on_epoch_end", 10), *[("on_save_checkpoint", 10),
                                         ("on_checkpoint_saved", 10)], ("on_fit_end", 10)]
    assert seen.seen == expected


class Noisy(torch.utils.data.Dataset):
    """48 samples, each input with noise from torch's stream as it is read (a random
    transform)."""

    samples = make_dataset(48)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        inputs, target = self.samples[index]
        return inputs + 0.01 * torch.randn(inputs.shape), target


def test_observers_and_validations_between_change_nothing(single_process):
    """A model with dropout: with a callback on every hook and a validation every 2 steps,
    the run ends bitwise equal to the same run without either ((every 5: a validation at
    each epoch's last step, which the epoch's end takes). The validation data draws noise
    from torch's stream as it is read (a random transform): the training's dropout after
    it stays what it is without it."""
    def fit(**settings) -> dict:
        torch.manual_seed(SEED)
        model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(),
                                    torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
        trainer = shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                                batch_size=48, **settings)
        trainer.fit(make_dataset(), Noisy(), epochs=3)
        return model.state_dict()
    plain = fit()
    for every in (2, 5):
        assert states_equal(fit(val_every_steps=every, callbacks=[Seen()]), plain), every


def test_an_exception_reaches_the_callbacks_and_is_raised_on(single_process):
    class Fails(shoal.Callback):
        def on_step_end(self, trainer, metrics):
            if metrics["step"] == 2:
                raise RuntimeError("boom")
    model, seen = make_model(), Seen()
    trainer = shoal.Trainer(model, make_optimizer(model), seed=SEED, progress=False,
                            batch_size=48, callbacks=[Fails(), seen])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(make_dataset())
    assert seen.seen[-1] == ("on_exception", 2)


def test_an_object_that_is_no_callback_is_refused_in_a_line(single_process):
    model = make_model()
    with pytest.raises(shoal.errors.UsageError, match=r"callbacks\[0\]: int is not a shoal"):
        shoal.Trainer(model, make_optimizer(model), callbacks=[3])


def _job(out: Path, *flags: str) -> tuple[str, list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    process = start_piped([sys.executable, "-m", "shoal", "run", "--nproc-per-node", "2",
                           "--max-restarts", "1", "--hang-timeout", "0", JOB, str(out),
                           *flags])
    output = process.communicate(timeout=TIMEOUT)[0].decode()
    assert process.returncode == 0, output[-4000:]
    return output, [torch.load(out / f"final.r{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.timeout(TIMEOUT * 2)
def test_early_stopping_stops_every_rank_at_one_step_also_after_a_kill(tmp_path):
    """2 processes, dropout, a validation every 4 steps: early stopping stops both ranks
    after the same step. With an observer on every hook the run ends bitwise equal (its
    validations keep the training's random streams), and its 2 best checkpoints are kept
    beside the last ones. Rank 1 SIGKILLed at step 50 (a checkpoint every 3): the resumed
    run stops at the same step, with the same weights, the same early stopping state and
    the same best checkpoints, and the observer's own state (its steps) resumed."""
    output, calm = _job(tmp_path / "calm")
    assert calm[0]["step"] == calm[1]["step"] < 8 * 23, output[-3000:]
    stopped = calm[0]["step"]
    assert f"shoal: stopping after step {stopped}: early stopping: val_loss did not " \
        "improve" in output
    assert states_equal(calm[0]["model"], calm[1]["model"])
    _, observed = _job(tmp_path / "observed", "--observers")
    assert states_equal(observed[0]["model"], calm[0]["model"])
    assert observed[0]["steps_seen"] == stopped
    best = _kept_best(tmp_path / "observed", observed[0]["best"])
    output, killed = _job(tmp_path / "killed", "--observers", "--kill", "1:50")
    assert "killed by SIGKILL" in output and "resumed from" in output, output[-3000:]
    assert [k["step"] for k in killed] == [stopped, stopped]
    assert states_equal(killed[0]["model"], calm[0]["model"])
    assert killed[0]["stopping"] == calm[0]["stopping"]
    assert killed[0]["steps_seen"] == stopped  # 48 before the resume (step 48's checkpoint)
    assert killed[0]["seen"][:2] == ["on_resume", "on_fit_start"]
    assert killed[0]["best"] == observed[0]["best"]
    assert _kept_best(tmp_path / "killed", killed[0]["best"]) == best
    # A run that had stopped has finished: a restart trains nothing.
    output, again = _job(tmp_path / "killed", "--observers")
    assert f"the run had finished at step {stopped} (early stopping" in output
    assert again[0]["step"] == stopped
    assert again[0]["seen"] == ["on_resume", "on_fit_start", "on_fit_end"]


@pytest.mark.timeout(TIMEOUT * 2)
def test_observers_change_nothing_under_fsdp(tmp_path):
    """The same job under fsdp (ZeRO-3: sharded parameters): with the observers and the best
    checkpoints it stops at the same step with the same weights as without them."""
    _, calm = _job(tmp_path / "calm", "--strategy", "fsdp")
    _, observed = _job(tmp_path / "observed", "--strategy", "fsdp", "--observers")
    assert observed[0]["step"] == calm[0]["step"]
    assert all(states_equal(observed[r]["model"], calm[r]["model"]) for r in (0, 1))
    _kept_best(tmp_path / "observed", observed[0]["best"])


def _kept_best(out: Path, best: list[tuple[float, int]]) -> list[dict]:
    """The 2 best validations' checkpoints, named in best.json, best first, kept beside
    the newest 3 (a checkpoint every 3 steps, a validation every 4): no other."""
    listed = json.loads((out / "checkpoints" / "best.json").read_text())["best"]
    assert [(entry["val_loss"], entry["step"]) for entry in listed] == best and len(best) == 2
    assert best[0][0] <= best[1][0]
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert set(kept) == set(kept[-3:]) | {entry["path"] for entry in listed}, kept
    return listed


def test_a_run_config_names_callbacks_by_import_path(tmp_path):
    """`trainer.callbacks` in a run config (here an override): early stopping with a bar
    no validation clears stops the run at the second validation, said in a line; the
    callbacks are kept in the run's config.yaml. A path that names nothing is one line."""
    spec = '[{builder: "shoal:EarlyStopping", args: {patience: 1, min_delta: 100}}]'
    run = tmp_path / "run"
    result = run_shoal("train", "--config", "examples/digits.yaml", "--nproc-per-node", "2",
                       f"run.dir={run}", "trainer.progress=false", "trainer.epochs=3",
                       "trainer.val_every_steps=5", f"trainer.callbacks={spec}",
                       timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shoal: stopping after step 10: early stopping" in result.stderr
    assert json.loads((run / "metrics.json").read_text())["global_step"] == 10
    assert "shoal:EarlyStopping" in (run / "config.yaml").read_text()
    wrong = run_shoal("train", "--config", "examples/digits.yaml", f"run.dir={run}",
                      "trainer.callbacks=[nowhere:Callback]", timeout=TIMEOUT)
    assert wrong.returncode == 2 and "trainer.callbacks[0]" in wrong.stderr, wrong.stderr
