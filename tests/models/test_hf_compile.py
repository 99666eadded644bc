"""trainer.compile on a transformers model: its layers compiled one by one (the sharded
strategies' way), trained to the result of the eager hand-written loop of one process.

The costliest test of the folder (inductor compiles GPT-2's block on the CPU: about a
minute with a cold cache), so it is the one compiled case: the compile order of every
strategy is tested on shoal's own GPT in tests/parallel/test_compile.py."""

from __future__ import annotations

import pytest

import shoal
from tests.helpers import max_rel_diff
from tests.models.hf_models import make_model, make_optimizer, reference, samples
from tests.models.test_hf import WEIGHT_TOLERANCE, _with_gradient

BATCH, STEPS = 8, 3
# Inductor's kernels may sum in another order than eager ones (tests/parallel/test_compile.py);
# the weights' difference is that rounding passed on by AdamW, as between processes (1.1e-4).
LOSS_TOLERANCE = 1e-5


@pytest.mark.timeout(400)
def test_compiled_gpt2_matches_eager(single_process):
    model = make_model("gpt2")
    losses: list[float] = []
    model.register_forward_hook(lambda _, __, outputs: losses.append(outputs.loss.item()))
    trainer = shoal.Trainer(model, make_optimizer(model), strategy="fsdp", compile=True,
                            batch_size=BATCH, seed=3, progress=False)
    layers = trainer.module.transformer.h
    assert all(layer._compiled_call_impl is not None for layer in layers)
    trainer.fit(samples(), max_steps=STEPS)
    expected = reference("gpt2", STEPS, BATCH)
    for step, (got, want) in enumerate(zip(losses, expected["losses"], strict=True)):
        assert abs(got - want) <= LOSS_TOLERANCE * want, (step, got, want)
    weights = _with_gradient({k: v.full_tensor() for k, v in trainer.module.state_dict().items()})
    assert max_rel_diff(weights, _with_gradient(expected["weights"])) <= WEIGHT_TOLERANCE
