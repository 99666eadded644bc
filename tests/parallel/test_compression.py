"""Gradient compression hooks: lossless settings equal plain DDP, lossy ones keep what they
do not send, and every byte is counted."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

import shoal
import shoal.errors
from shoal.parallel.powersgd import PowerSGDHook
from shoal.parallel.topk import TopKHook, select, sum_of_selections
from shoal.parallel.traffic import Traffic
from tests.helpers import max_rel_diff
from tests.training.reference import (
    SEED,
    make_dataset,
    make_model,
    make_optimizer,
    reference_weights,
)

BATCH, STEPS = 8, 12
N_PARAMS = 10 * 16 + 16 + 16 * 3 + 3  # the reference MLP: 227 fp32 values, 908 bytes


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# Every Trainer run of this file, by name: one job of 2 processes runs them all.
RUNS = {
    "none": {},
    "topk 100%": {"compression": {"name": "topk", "ratio": 1.0}},
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16"},
    "topk": {"compression": {"name": "topk", "ratio": 0.1}},
    "powersgd": {"compression": {"name": "powersgd", "warmup_steps": 2}},
    "local_sgd": {"strategy": "local_sgd", "local_sgd": {"period": 4}},
    "diloco bf16": {"strategy": "diloco", "diloco": {"period": 4, "outer_dtype": "bf16"}},
}


def _fit_all() -> dict[str, tuple[dict, dict]]:
    shoal.init("gloo")
    results = {}
    for name, settings in RUNS.items():
        model = make_model()
        trainer = shoal.Trainer(model, make_optimizer(model), batch_size=BATCH, seed=SEED,
                                progress=False, **settings)
        metrics = trainer.fit(make_dataset(), max_steps=STEPS)
        results[name] = (_state(trainer.module), metrics)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, tuple[dict, dict]]]:
    return shoal.spawn(_fit_all, nprocs=2)


def test_topk_keeping_everything_is_plain_all_reduce(runs):
    expected = reference_weights(global_batch=2 * BATCH, steps=STEPS)
    for rank in range(2):
        plain, topk = runs[rank]["none"][0], runs[rank]["topk 100%"][0]
        assert max_rel_diff(plain, expected) <= 1e-5
        # Same sums in the same order: bit for bit.
        for key, value in plain.items():
            assert torch.equal(topk[key], value), (rank, key)


@pytest.mark.parametrize("name, tolerance", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_half_precision_all_reduce_matches_reference(runs, name, tolerance):
    expected = reference_weights(global_batch=2 * BATCH, steps=STEPS)
    for result in runs:
        weights, metrics = result[name]
        diff = max_rel_diff(weights, expected)
        assert diff <= tolerance, f"{name}: rel diff {diff:.2e}"
        assert metrics["comm_bytes_per_step"] == N_PARAMS * 2  # half of fp32's 908


def test_bytes_per_step_are_counted_where_they_are_sent(runs):
    # W=2: a ring all-reduce of S bytes sends S from each rank, an all-gather of S sends S.
    expected = {
        "none": N_PARAMS * 4,
        # 10 % of 227 entries: 22 values (4 bytes) and 22 int32 positions.
        "topk": 22 * 8,
        # 2 plain steps, then per step: rank-1 factors of the 16x10 and 3x16 weights
        # (26 + 19 values) and the biases uncompressed (16 + 3).
        "powersgd": (2 * N_PARAMS * 4 + 10 * (26 + 19 + 16 + 3) * 4) / STEPS,
        # Averaged weights every 4 steps: 3 all-reduces of 908 bytes in 12 steps.
        "local_sgd": 3 * N_PARAMS * 4 / STEPS,
        "diloco bf16": 3 * N_PARAMS * 2 / STEPS,
    }
    for result in runs:
        for case, value in expected.items():
            metrics = result[case][1]
            assert metrics["comm_bytes_per_step"] == pytest.approx(value, rel=1e-12), case
            assert metrics["comm_wait_s_per_step"] >= 0


def test_select_partitions_the_gradient():
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    positions, values, residual = select(flat, 10)
    assert torch.equal(values.abs().sort().values, flat.abs().topk(10).values.sort().values)
    rebuilt = residual.clone()
    rebuilt[positions] = values
    assert torch.equal(rebuilt, flat)
    assert (residual != 0).sum() == 990


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_selections_is_the_scattered_mean_from_any_row(dtype):
    """Three ranks' messages (values' bytes, then int32 positions), k odd: a bfloat16 row
    of 3 x (2 + 4) bytes puts the third rank's positions off a multiple of 4."""
    generator = torch.Generator().manual_seed(0)
    flats = [torch.randn(50, generator=generator).to(dtype) for _ in range(3)]
    expected = torch.zeros(50, dtype=dtype)
    rows = []
    for flat in flats:
        positions, values, _ = select(flat, 3)
        expected.index_add_(0, positions, values)
        rows.append(torch.cat([values.view(torch.uint8),
                               positions.to(torch.int32).view(torch.uint8)]))
    expected /= 3
    gathered = torch.stack(rows)
    assert torch.equal(sum_of_selections(gathered, flats[0], 3), expected)
    # as kept in a live log: a view of rows gathered with more bytes after each
    wider = torch.cat([gathered, torch.zeros(3, 12, dtype=torch.uint8)], 1)
    assert torch.equal(sum_of_selections(wider[:, :gathered.shape[1]], flats[0], 3),
                       expected)


def _error_feedback(steps: int) -> dict:
    """W=1, so what the hook returns is what this rank sent."""
    shoal.init("gloo")
    model = make_model()
    plain = make_model()  # same weights, no hook: the true gradients
    ddp = DistributedDataParallel(model)
    state = TopKHook(model, 0.05, Traffic())
    ddp.register_comm_hook(state, TopKHook.hook)
    x, y = make_dataset().tensors
    sent = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    true = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    nonzero = []
    for step in range(steps):  # no optimizer step: weights stay, the batches change
        batch = slice(step * 16, (step + 1) * 16)
        for net, total in ((ddp, sent), (plain, true)):
            net.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x[batch]), y[batch]).backward()
            params = (model if net is ddp else plain).named_parameters()
            for n, p in params:
                total[n] += p.grad
        nonzero.append(sum(int((p.grad != 0).sum()) for p in model.parameters()))
    return {"sent": sent, "true": true, "residuals": state.residuals, "nonzero": nonzero}


def test_error_feedback_keeps_what_is_not_sent():
    out = shoal.spawn(_error_feedback, nprocs=1, args=(6,))[0]
    k = int(N_PARAMS * 0.05)
    assert all(n <= k for n in out["nonzero"]), out["nonzero"]  # only k entries each step
    for name, true_sum in out["true"].items():
        residual = out["residuals"][name]
        torch.testing.assert_close(out["sent"][name] + residual, true_sum, rtol=0, atol=1e-6)
    assert any(r.abs().sum() > 1e-3 for r in out["residuals"].values())


def _powersgd_both_ways(steps: int) -> dict:
    shoal.init("gloo")
    results = {}
    for kind in ("shoal", "torch", "plain"):
        model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                              nn.Linear(16, 3))
        torch.manual_seed(SEED)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.3)
        # One bucket: torch's hook alone mismatches collectives on gloo with several.
        ddp = DistributedDataParallel(model)
        if kind == "shoal":
            state = PowerSGDHook(model, rank=2, warmup_steps=2, traffic=Traffic(), seed=5)
            ddp.register_comm_hook(state, PowerSGDHook.hook)
        elif kind == "torch":
            ddp.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=2,
                                                 start_powerSGD_iter=2, random_seed=5),
                                   powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = make_dataset().tensors
        for step in range(steps):
            rows = slice(step * 8 + shoal.rank() * 4, step * 8 + shoal.rank() * 4 + 4)
            torch.nn.functional.cross_entropy(ddp(x[rows]), y[rows]).backward()
            opt.step()
            opt.zero_grad()
        results[kind] = _state(model)
    return results


def test_powersgd_is_torch_powersgd():
    # The per-parameter bookkeeping changes nothing in torch's algorithm.
    for result in shoal.spawn(_powersgd_both_ways, nprocs=2, args=(8,)):
        for key, value in result["torch"].items():
            assert torch.equal(result["shoal"][key], value), key
        assert max_rel_diff(result["shoal"], result["plain"]) > 1e-4  # it did compress


@pytest.mark.parametrize("settings, needles", [
    ({"compression": {"name": "topk", "ratio": 0.0}}, ["compression.ratio", "greater than 0"]),
    ({"compression": {"name": "topk", "ratio": 1.01}}, ["compression.ratio", "less than or"]),
    ({"compression": {"name": "powersgd", "rank": 0}}, ["compression.rank"]),
    ({"compression": {"name": "powersgd", "warmup_steps": 1}}, ["compression.warmup_steps"]),
    ({"local_sgd": {"period": 0}}, ["local_sgd.period"]),
    ({"diloco": {"period": 0}}, ["diloco.period"]),
    ({"diloco": {"outer_momentum": 1.0}}, ["diloco.outer_momentum"]),
    ({"strategy": "local_sgd", "compression": "powersgd"},
     ["compression 'powersgd'", "strategy 'local_sgd'"]),
    ({"strategy": "diloco", "nonfinite": "skip"}, ["nonfinite", "strategy 'diloco'"]),
])
def test_invalid_settings_fail_before_training(settings, needles):
    with pytest.raises(shoal.errors.UsageError) as caught:
        shoal.TrainerConfig.build(**settings)
    message = str(caught.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
