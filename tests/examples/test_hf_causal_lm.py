"""examples/hf_causal_lm.yaml: a transformers model named in a run config trains under
`shoal train` on 2 processes and exports as a save_pretrained directory; a model class or
config argument that does not exist, or a missing transformers, is one line and exit 2
before anything starts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.cli.test_bad_input import _assert_one_line_error
from tests.helpers import run_shoal, run_shoal_in_process

pytest.importorskip("transformers", reason="needs shoal[hf] (the test extra has it)")

EXAMPLE = "examples/hf_causal_lm.yaml"
TINY = ("model.hf.config={vocab_size: 256, n_positions: 32, n_embd: 32, n_layer: 2, "
        "n_head: 2, use_cache: false, bos_token_id: 0, eos_token_id: 0}")


def test_example_trains_on_two_processes(tmp_path):
    out = run_shoal("train", "--config", EXAMPLE, "--nproc-per-node", "2", TINY,
                    "trainer.max_steps=3", "trainer.batch_size=8",
                    "data.args.seq_len=32", "data.args.max_bytes=100000",
                    f"run.dir={tmp_path}", f"trainer.checkpoint_dir={tmp_path}/checkpoints",
                    timeout=150)
    assert out.returncode == 0, out.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 3 and math.isfinite(metrics["val_loss"])
    assert abs(metrics["val_loss"] - math.log(256)) < 0.5  # 3 steps from a random init
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("tokens_per_s", 0) > 0 for r in steps if r["type"] == "step")
    assert "val_loss" in out.stdout and "tokens/s" in out.stdout  # what the run reports
    # Out of shoal: the final checkpoint as a save_pretrained directory that transformers
    # loads alone, with the trained weights to the bit.
    from transformers import GPT2LMHeadModel

    from shoal.checkpoint.export import checkpoint_of, read_weights

    exported = run_shoal_in_process("export", str(tmp_path / "checkpoints"),
                                    str(tmp_path / "hf"), "--format", "hf")
    assert exported.returncode == 0, exported.stderr
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).state_dict()
    trained = read_weights(checkpoint_of(tmp_path / "checkpoints"))
    assert trained.keys() <= loaded.keys()
    assert all(torch.equal(loaded[k], v) for k, v in trained.items())


@pytest.mark.parametrize("override, needles", [
    ("model.hf.class=GPT2LMHeadModle",
     ["model.hf", "transformers has no model class 'GPT2LMHeadModle'", "'GPT2LMHeadModel'"]),
    ("model.hf.config.n_layers=2",
     ["model.hf", "GPT2Config has no argument 'n_layers'", "'n_layer'"]),
    ("model.hf.config.n_layer=two", ["model.hf", "GPT2Config", "n_layer", "expected int"]),
    ("model.builder=shoal.examples.gpt:build_model", ["model", "either builder", "or hf"]),
])
def test_bad_model_is_one_line_before_launch(override, needles):
    _assert_one_line_error(run_shoal_in_process("train", "--config", EXAMPLE, override),
                           *needles)


def test_missing_transformers_names_the_extra(tmp_path):
    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('injected: not installed')\n")
    out = run_shoal("train", "--config", EXAMPLE, env={"PYTHONPATH": str(tmp_path)})
    _assert_one_line_error(out, "transformers", "pip install 'shoal[hf]'")
