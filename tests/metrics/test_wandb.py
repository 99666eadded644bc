"""Weights & Biases, for real in offline mode: a 2-process `shoal train` logs one run from
rank 0; a worker SIGKILLed before any checkpoint and restarted, then the job resumed later
for another epoch, keep that one run (offline, one folder per attempt, one run id); its
files hold every step's figures as metrics.jsonl has them, each validation and the final
metrics; without the package the config names the extra in one line."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from tests.ft.runs import step_metrics
from tests.helpers import run_shoal, run_shoal_in_process

pytest.importorskip("wandb")

STEPS_PER_EPOCH = 23  # digits: 1437 training samples / (2 ranks x 32)
KILLED_AT = 7  # rank 0 of the first attempt SIGKILLs itself after this step
RUN_S = 150  # a hang guard for each job, several times its length here

KILLER = '''
import os, signal
import shoal

class KillOnce(shoal.Callback):
    def on_step_end(self, trainer, metrics):
        if (metrics["step"] == {step} and shoal.rank() == 0
                and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
            os.kill(os.getpid(), signal.SIGKILL)
'''


def _records(path: Path):
    """The protobuf records of a run's .wandb file (a LevelDB-style log of 32 KiB blocks,
    after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, parts = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk  # full or first; middle or last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def _logged(run_dir: Path) -> tuple[list[str], dict[int, dict], dict]:
    """(the run id of each offline folder, in order; the figures of each step, the last
    folder's where several logged one; the last summary)."""
    ids, steps, summary = [], {}, {}
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        ids.append(folder.name.rsplit("-", 1)[1])
        for record in _records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in record.history.item}
                steps[row["_step"]] = row
            elif kind == "summary":
                summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                for i in record.summary.update})
    return ids, steps, summary


@pytest.fixture(scope="module")
def restarted_and_resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    (root / "killer.py").write_text(KILLER.format(step=KILLED_AT))
    run_dir = root / "run"
    args = ["train", "--config", "examples/digits.yaml", "--nproc-per-node", "2",
            f"run.dir={run_dir}", "trainer.metrics.every=5", "trainer.progress=false",
            "trainer.metrics.wandb.mode=offline", "trainer.metrics.wandb.project=digits",
            f"trainer.checkpoint_dir={root}/checkpoints", "trainer.checkpoint_every=20",
            "trainer.resume=auto", f'run.code_paths=["{root}"]']
    first = run_shoal(*args, "--max-restarts", "1", "trainer.epochs=2",
                      'trainer.callbacks=["killer:KillOnce"]', timeout=RUN_S)
    assert first.returncode == 0, first.stderr[-3000:]
    later = run_shoal(*args, "trainer.epochs=3", timeout=RUN_S)
    assert later.returncode == 0, later.stderr[-3000:]
    return run_dir, first.stderr + later.stderr


@pytest.mark.timeout(2 * RUN_S + 60)
def test_one_run_across_a_restart_and_a_resume_with_every_step(restarted_and_resumed):
    run_dir, err = restarted_and_resumed
    ids, steps, summary = _logged(run_dir)
    # Three attempts (killed, restarted from the beginning, resumed): one run.
    assert len(ids) == 3 and len(set(ids)) == 1, ids
    run_id = ids[0]
    assert err.count(f"[rank0]: shoal: W&B run {run_id} continued (") == 2, err[-3000:]
    assert err.count(f"[rank0]: shoal: W&B run {run_id} (") == 1
    assert "[rank1]: shoal: W&B" not in err
    assert json.loads((run_dir / "trackers.json").read_text()) == {"wandb_run_id": run_id}
    # Every step's loss and learning rate as metrics.jsonl has them; each epoch's validation.
    total = 3 * STEPS_PER_EPOCH
    written = step_metrics(run_dir)
    assert sorted(steps) == list(range(1, total + 1)) == [s for s, *_ in written]
    assert all(steps[s]["train/loss"] == loss for s, loss, *_ in written)
    assert [s for s in sorted(steps) if "val_loss" in steps[s]] == [
        STEPS_PER_EPOCH * (epoch + 1) for epoch in range(3)]
    # The final metrics, as the run directory has them.
    final = json.loads((run_dir / "metrics.json").read_text())
    assert summary["global_step"] == final["global_step"] == total
    assert summary["val_loss"] == final["val_loss"]


def test_without_the_wandb_package_the_config_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as uninstalled
    out = run_shoal_in_process("train", "--config", "examples/digits.yaml",
                               f"run.dir={tmp_path}", "trainer.metrics.wandb=true")
    assert out.returncode == 2
    assert out.stderr == ("shoal train: error: invalid configuration: trainer.metrics.wandb: "
                          "Weights & Biases logging needs the wandb package: "
                          "pip install 'shoal[wandb]'\n")

