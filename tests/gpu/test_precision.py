"""The Trainer on the GPU at each precision trains the reference MLP as on the CPU.

Reference: the same Trainer, seed and data in fp32 on the CPU (gloo), itself checked
against plain torch (tests/training/reference.py). Two epochs of 30 SGD-with-momentum
steps. Tolerances, relative, from measurements on the CPU with the reference loop:

- fp32 (TF32 off): the GPU adds in another order. fp32 against fp64 differs by 3e-7 in
  the losses and 1.4e-6 in the weights after 60 steps; allowed 1e-5 and 1e-4.
- bf16 autocast (8 bits of mantissa): losses 2.4e-3 from fp32's, weights 1.7e-2; allowed
  2e-2 and 5e-2 (as tests/training/test_precision.py).
- fp16 autocast with loss scaling (11 bits): losses 1.9e-4, weights 3.7e-3; allowed 1e-2
  and 2e-2.
"""

from __future__ import annotations

import pytest
import torch

import shoal
from tests.gpu.common import BACKEND, DEVICE, device_of, exact_fp32, recording
from tests.helpers import max_rel_diff
from tests.training.reference import (
    SEED,
    make_dataset,
    make_model,
    make_optimizer,
    reference_weights,
)

BATCH, STEPS = 8, 60  # 30 steps an epoch: two epochs
TOLERANCES = {  # precision: (autocast dtype, loss, weights), relative
    "32": (torch.float32, 1e-5, 1e-4),
    "bf16-mixed": (torch.bfloat16, 2e-2, 5e-2),
    "fp16-mixed": (torch.float16, 1e-2, 2e-2),
}


def _train(precision: str, backend: str) -> dict:
    model = make_model()
    dtypes: set[torch.dtype] = set()
    model[0].register_forward_hook(lambda m, i, out: dtypes.add(out.dtype))
    losses: list[float] = []
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=BATCH, seed=SEED,
                            loss_fn=recording(losses, torch.nn.functional.cross_entropy),
                            precision=precision, backend=backend, progress=False)
    trainer.fit(make_dataset(), max_steps=STEPS)
    return {"losses": losses, "epochs": [h["train_loss"] for h in trainer.history],
            "weights": {k: v.cpu().clone() for k, v in trainer.module.state_dict().items()},
            "dtypes": dtypes, "device": device_of(trainer),
            "backend": torch.distributed.get_backend()}


def _runs(backend: str, precisions: tuple[str, ...]) -> dict[str, dict]:
    exact_fp32()
    shoal.init(backend)
    return {p: _train(p, backend) for p in precisions}


@pytest.fixture(scope="module")
def cpu() -> dict:
    return shoal.spawn(_runs, nprocs=1, args=("gloo", ("32",)))[0]["32"]


@pytest.fixture(scope="module")
def gpu() -> dict[str, dict]:
    return shoal.spawn(_runs, nprocs=1, args=(BACKEND, tuple(TOLERANCES)))[0]


def test_the_cpu_reference_is_plain_torch(cpu):
    diff = max_rel_diff(cpu["weights"], reference_weights(global_batch=BATCH, steps=STEPS))
    assert diff <= 1e-6, f"the CPU Trainer is {diff:.1e} from plain torch"
    assert len(cpu["losses"]) == STEPS and len(cpu["epochs"]) == 2
    assert (cpu["device"], cpu["backend"]) == ("cpu", "gloo")


@pytest.mark.parametrize("precision", TOLERANCES)
def test_gpu_precision_matches_cpu_fp32(cpu, gpu, precision):
    run = gpu[precision]
    dtype, loss_tol, weight_tol = TOLERANCES[precision]
    assert (run["device"], run["backend"]) == (DEVICE, BACKEND)
    assert run["dtypes"] == {dtype}, f"{precision}: the first layer ran in {run['dtypes']}"
    assert len(run["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(run["losses"], cpu["losses"], strict=True)):
        assert abs(got - want) <= loss_tol * abs(want), (precision, step, got, want)
    for epoch, (got, want) in enumerate(zip(run["epochs"], cpu["epochs"], strict=True)):
        assert abs(got - want) <= loss_tol * abs(want), (precision, epoch, got, want)
    diff = max_rel_diff(run["weights"], cpu["weights"])
    assert diff <= weight_tol, f"{precision}: weights differ by {diff:.2e}"
