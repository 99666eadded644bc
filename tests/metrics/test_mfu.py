"""Tokens per second and model FLOPs utilization: the model says its FLOPs per token, the
device (or the config) its peak, and every step record, the TensorBoard events and the
end-of-run line carry the ratio."""

from __future__ import annotations

import json

import pytest
import torch

import shoal
from shoal.examples.gpt import build_model, loss
from shoal.metrics.flops import lookup, peak_flops

PEAK = 1e12  # a made-up device: the CPU has no entry in the table
SEQ, BATCH, STEPS = 16, 4, 6


def _tokens() -> torch.utils.data.TensorDataset:
    ids = torch.randint(0, 64, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])


def test_gpt_flops_per_token_counts_every_matrix_weight():
    model = build_model(vocab_size=64, seq_len=SEQ, n_layer=2, n_head=2, d_model=32)
    c = model.config
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if not name.startswith(("tok_emb", "pos_emb")))
    assert model.flops_per_token() == 6 * weights + 12 * c.n_layer * c.d_model * c.seq_len


def test_mfu_in_every_step_record_and_the_summary(tmp_path, single_process, capsys):
    model = build_model(vocab_size=64, seq_len=SEQ, n_layer=2, n_head=2, d_model=32)
    trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            loss_fn=loss, batch_size=BATCH, max_steps=STEPS, progress=True,
                            metrics={"dir": str(tmp_path), "every": 2, "peak_flops": PEAK,
                                     "tensorboard": False})
    trainer.fit(_tokens())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
               .splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == STEPS
    for r in steps:
        assert r["tokens_per_s"] == pytest.approx(BATCH * SEQ / r["step_time_s"], rel=1e-9)
        assert r["mfu"] == pytest.approx(
            r["tokens_per_s"] * model.flops_per_token() / PEAK, rel=1e-9)
    assert "tokens/s, MFU" in capsys.readouterr().out


def test_no_mfu_without_a_peak(tmp_path, single_process):
    model = build_model(vocab_size=64, seq_len=SEQ, n_layer=1, n_head=2, d_model=32)
    trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            loss_fn=loss, batch_size=BATCH, max_steps=2, progress=False,
                            metrics={"dir": str(tmp_path), "tensorboard": False})
    trainer.fit(_tokens())
    records = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    steps = [r for r in records if r["type"] == "step"]
    assert steps and all("tokens_per_s" in r and "mfu" not in r for r in steps)


def test_peak_table():
    assert lookup("NVIDIA H100 80GB HBM3")[0] == pytest.approx(989.4e12)
    assert lookup("NVIDIA H100 PCIe")[0] == pytest.approx(756e12)
    assert lookup("NVIDIA H200")[0] == pytest.approx(989.4e12)
    assert lookup("NVIDIA A100-SXM4-80GB")[0] == pytest.approx(312e12)
    assert lookup("NVIDIA A10G")[0] == pytest.approx(70e12)  # not the A100's
    assert lookup("Tesla V100-SXM2-16GB")[0] == pytest.approx(125e12)
    assert lookup("Some Future Accelerator") is None
    assert peak_flops(torch.device("cpu"), "bf16-mixed") is None
