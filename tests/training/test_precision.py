"""Mixed precision: autocast really runs in low precision, training stays close to fp32,
and an fp16 overflow skips the step instead of corrupting the weights."""

from __future__ import annotations

import pytest
import torch

import shoal
from tests.helpers import max_rel_diff
from tests.training.reference import (
    SEED,
    make_dataset,
    make_model,
    make_optimizer,
    reference_weights,
)

BATCH, STEPS = 8, 12
# bf16 keeps 8 bits of mantissa: after 12 momentum steps weights drift by about 1e-2.
TOLERANCE = 5e-2


def _train(precision: str):
    shoal.init("gloo")
    model = make_model()
    seen = set()
    model[0].register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=BATCH, seed=SEED,
                            precision=precision, progress=False)
    trainer.fit(make_dataset(), max_steps=STEPS)
    scaler = trainer.harness.precision.scaler
    return {"weights": {k: v.clone() for k, v in trainer.module.state_dict().items()},
            "dtypes": seen, "scale": scaler.get_scale() if scaler else None}


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", torch.bfloat16),
                                              ("fp16-mixed", torch.float16)])
def test_mixed_precision_is_close_to_fp32(precision, dtype):
    results = shoal.spawn(_train, nprocs=2, args=(precision,))
    expected = reference_weights(global_batch=2 * BATCH, steps=STEPS)
    for result in results:
        assert result["dtypes"] == {dtype}
        diff = max_rel_diff(result["weights"], expected)
        assert 0 < diff <= TOLERANCE, f"{precision}: rel diff {diff:.2e}"
        if precision == "fp16-mixed":
            assert result["scale"] is not None and 0 < result["scale"] < float("inf")
    assert all(torch.equal(results[0]["weights"][k], results[1]["weights"][k])
               for k in results[0]["weights"])


def test_fp16_overflow_skips_the_step(single_process):
    harness = shoal.Harness(precision="fp16-mixed")
    model, opt = harness.setup(make_model(), None)
    opt = make_optimizer(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = make_dataset().tensors
    with harness.autocast():
        loss = torch.nn.functional.cross_entropy(model(x[:8]), y[:8]) * float("inf")
    harness.backward(loss)
    scale = harness.precision.scaler.get_scale()
    harness.step(opt)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert harness.precision.scaler.get_scale() == scale / 2
