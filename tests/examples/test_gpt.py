"""The example GPT: deterministic, counted, causal, splittable by heads, and trainable."""

from __future__ import annotations

import json
import math
from itertools import islice

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn
from torch.utils.data import DataLoader

from shoal.data.text import build_data
from shoal.examples.gpt import (
    GPT,
    GPT_57M,
    CausalSelfAttention,
    GPTConfig,
    build_loss,
    build_model,
    config_for_parameters,
    count_parameters,
    loss,
    parameter_count,
)
from tests.helpers import run_shoal

TINY = dict(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=32)


def test_build_model_depends_on_the_seed_only_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = build_model(**TINY, seed=1), build_model(**TINY, seed=1), build_model(**TINY)
    assert torch.equal(torch.random.get_rng_state(), before)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(),
                               c.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
        if name.endswith(("q.weight", "head.weight")):
            assert not torch.equal(x, z), name
    assert torch.all(a.blocks[0].attn.q.bias == 0) and torch.all(a.norm.weight == 1)
    # The residual projections start smaller (GPT-2's scaled init).
    assert a.blocks[0].mlp.proj.weight.std() < 0.7 * a.blocks[0].mlp.fc.weight.std()


@pytest.mark.parametrize("shape", [TINY, {}, dict(n_layer=3, d_model=48, n_head=6,
                                                   mlp_ratio=2, seq_len=7, vocab_size=11)])
def test_parameter_count_formula(shape):
    model = build_model(**shape)
    assert count_parameters(model) == parameter_count(model.config)


def test_the_large_preset_is_over_50_million_parameters():
    with torch.device("meta"):  # counted without allocating 229 MB
        model = GPT(GPT_57M)
    assert count_parameters(model) == parameter_count(GPT_57M) == 57_294_336
    config = config_for_parameters(50_000_000)
    assert parameter_count(config) >= 50_000_000 > parameter_count(
        config.model_copy(update={"n_layer": config.n_layer - 1}))
    assert parameter_count(GPTConfig()) == 875_264


def test_config_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValidationError, match=r"d_model \(100\) must be a multiple of n_head"):
        GPTConfig(d_model=100, n_head=3)
    with pytest.raises(ValidationError):
        GPTConfig(n_layer=0)


def test_forward_shape_pieces_and_loss():
    model = build_model(**TINY)
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256)
    assert torch.equal(logits, model.logits(model.run_blocks(model.embed(idx))))
    targets = torch.randint(0, 256, (3, 16))
    expected = F.cross_entropy(logits.reshape(48, 256), targets.reshape(48))
    assert torch.allclose(build_loss()(logits, targets), expected)
    with pytest.raises(ValueError, match="longer than seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_is_causal():
    model = build_model(**TINY).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    before, after = model(idx), model(changed)
    assert torch.equal(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def _rows(linear: nn.Linear, rows: slice) -> nn.Linear:
    part = nn.Linear(linear.in_features, rows.stop - rows.start)
    part.weight.data, part.bias.data = linear.weight[rows].clone(), linear.bias[rows].clone()
    return part


def test_attention_with_a_share_of_the_heads_gives_that_share_of_the_output():
    """Tensor parallelism's split: q, k, v by output rows, proj by input columns; the
    partial outputs of the ranks add up to the whole (proj's bias added once)."""
    attn = CausalSelfAttention(GPTConfig(d_model=32, n_head=4)).eval()  # 2 heads per rank
    for layer in (attn.q, attn.k, attn.v, attn.proj):
        nn.init.normal_(layer.bias)
    x = torch.randn(2, 5, 32)
    total = attn.proj.bias.clone()
    for rank in range(2):
        share = slice(16 * rank, 16 * (rank + 1))
        local = CausalSelfAttention(GPTConfig(d_model=32, n_head=4)).eval()
        local.q, local.k, local.v = (_rows(f, share) for f in (attn.q, attn.k, attn.v))
        local.proj = nn.Linear(16, 32, bias=False)
        local.proj.weight.data = attn.proj.weight[:, share].clone()
        total = total + local(x)
    assert torch.allclose(total, attn(x), atol=1e-6)


def test_a_short_training_lowers_the_loss():
    torch.manual_seed(0)
    train, val = build_data(seq_len=32, max_bytes=200_000)
    model = build_model(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    held_out = next(iter(DataLoader(val, batch_size=64)))

    def val_loss() -> float:
        with torch.no_grad():
            return loss(model(held_out[0]), held_out[1]).item()

    start = val_loss()
    assert abs(start - math.log(256)) < 0.1  # small init: near-uniform predictions
    batches = DataLoader(train, batch_size=32, shuffle=True,
                         generator=torch.Generator().manual_seed(0))
    for inputs, targets in islice(batches, 30):
        loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert val_loss() < start - 1.5


def _train_example(run_dir, *overrides: str) -> tuple[dict, list[dict]]:
    out = run_shoal("train", "--config", "examples/gpt.yaml", "--nproc-per-node", "2",
                    "trainer.max_steps=3", "trainer.progress=false",
                    "model.args={seq_len: 32, n_layer: 2, n_head: 2, d_model: 32}",
                    "data.args={seq_len: 32, max_bytes: 100000}", f"run.dir={run_dir}",
                    *overrides, timeout=120)
    assert out.returncode == 0, out.stderr
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "metrics.json").read_text()), steps


def test_example_config_runs_on_two_processes_replicated_or_as_a_pipeline(tmp_path):
    metrics, steps = _train_example(tmp_path / "ddp")
    assert metrics["global_step"] == 3 and math.isfinite(metrics["val_loss"])
    assert any(r.get("tokens_per_s", 0) > 0 for r in steps if r["type"] == "step")
    # The same run as two pipeline stages: one dp rank takes the whole global batch.
    split, _ = _train_example(tmp_path / "pp", "trainer.parallel.pp=2",
                              "trainer.batch_size=64")
    for key in ("train_loss", "val_loss"):
        assert split[key] == pytest.approx(metrics[key], rel=1e-5), key
