"""Step metrics on the GPU: NVML's utilisation and memory per rank (with nvidia-ml-py), and
tokens per second and MFU in every step record of the GPT.

MFU is the model's FLOPs for a step's tokens over the device's peak in that time: with the
peak from shoal's table (an H100, say), or given in the config where the GPU is not in it.
Each record's figure is checked against that formula to 1e-6 relative (JSON keeps doubles),
and must lie in (0, 1): a GPU cannot beat its own peak.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

import shoal
from shoal.examples import gpt
from shoal.metrics.flops import peak_flops
from shoal.metrics.resources import ResourceSampler
from tests.gpu.common import BACKEND, GPT, adamw, init, make_gpt, records, tokens

BATCH, STEPS, EVERY = 8, 6, 2
PRECISION = "bf16-mixed"
FALLBACK_PEAK = 1e15  # for a GPU that shoal's table does not know
ALLOCATION = 2**30  # bytes the sampler must see appear


def _finite(value) -> bool:
    """A number, not NaN or infinite (a figure NVML did not give is written as null)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def _sample_allocation() -> dict:
    """NVML's view of this GPU before and after a 1 GiB allocation."""
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # the CUDA context exists before the first figure
    sampler = ResourceSampler(device, interval=0.05).start()
    time.sleep(0.2)
    before = sampler.take()
    block = torch.empty(ALLOCATION, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    time.sleep(0.2)
    sampler.take()  # a sample may predate the allocation: this window is dropped
    time.sleep(0.2)
    after = sampler.take()
    sampler.stop()
    del block
    return {"before": before, "after": after}


def _train(directory: str) -> dict:
    device = init()
    peak = peak_flops(device, PRECISION)
    metrics = {"dir": directory, "every": EVERY, "tensorboard": False,
               "resource_interval": 0.1}
    if peak is None:
        metrics["peak_flops"] = FALLBACK_PEAK
    model = make_gpt()
    trainer = shoal.Trainer(model, adamw(model), loss_fn=gpt.loss, batch_size=BATCH,
                            precision=PRECISION, seed=GPT["seed"], backend=BACKEND,
                            progress=False, metrics=metrics)
    trainer.fit(tokens(), max_steps=STEPS)
    return {"peak": peak or FALLBACK_PEAK, "flops_per_token": model.flops_per_token()}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("metrics")
    return {"dir": directory, **shoal.spawn(_train, nprocs=1, args=(str(directory),))[0]}


def test_sampler_sees_gpu_use_through_nvml():
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    seen = shoal.spawn(_sample_allocation, nprocs=1)[0]
    for figures in seen.values():
        assert _finite(figures["gpu_util_percent"]), figures
        assert 0 <= figures["gpu_util_percent"] <= 100, figures
        assert _finite(figures["gpu_memory_bytes"]) and figures["gpu_memory_bytes"] > 0
    grown = seen["after"]["gpu_memory_bytes"] - seen["before"]["gpu_memory_bytes"]
    assert grown >= 0.9 * ALLOCATION, f"NVML saw {grown / 2**20:.0f} MiB more, not 1 GiB"


def test_rank_records_carry_gpu_figures(run):
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    windows = records(run["dir"], "ranks")
    assert len(windows) == STEPS // EVERY
    for window in windows:
        (rank,) = window["ranks"]
        assert _finite(rank["gpu_util_percent"]), rank
        assert 0 <= rank["gpu_util_percent"] <= 100, rank
        assert _finite(rank["gpu_memory_bytes"]) and rank["gpu_memory_bytes"] > 0, rank


def test_step_records_carry_tokens_per_second_and_mfu(run):
    steps = records(run["dir"], "step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["tokens_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(
            BATCH * GPT["seq_len"] / r["step_time_s"], rel=1e-6)
        assert r["mfu"] == pytest.approx(
            r["tokens_per_s"] * run["flops_per_token"] / run["peak"], rel=1e-6)
        assert 0 < r["mfu"] < 1, r
