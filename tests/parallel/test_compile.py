"""trainer.compile: the model is compiled where each strategy wants it, and trains to the
same result as without compile.

On the CPU, inductor may order floating-point sums differently from eager kernels, so
results are compared within a tolerance: losses 1e-5 relative, weights 1e-4.
"""

from __future__ import annotations

import pytest
import torch

import shoal
from shoal.examples.gpt import build_model, loss
from tests.helpers import max_rel_diff
from tests.training.reference import (
    SEED,
    make_dataset,
    make_model,
    make_optimizer,
    reference_weights,
)

BATCH, STEPS = 8, 6


def _ddp_compiled() -> dict[str, torch.Tensor]:
    shoal.init("gloo")
    model = make_model()
    trainer = shoal.Trainer(model, make_optimizer(model), batch_size=BATCH, seed=SEED,
                            progress=False, compile=True)
    # After DDP: the wrapper itself is compiled, so its graph splits at the buckets.
    assert isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
    assert trainer.model._compiled_call_impl is not None
    trainer.fit(make_dataset(), max_steps=STEPS)
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


@pytest.mark.timeout(300)
def test_ddp_compiled_at_two_processes_matches_one_process():
    weights = shoal.spawn(_ddp_compiled, nprocs=2)
    reference = reference_weights(global_batch=2 * BATCH, steps=STEPS)
    for rank_weights in weights:
        assert max_rel_diff(rank_weights, reference) < 1e-4


def _tokens() -> torch.utils.data.TensorDataset:
    ids = torch.randint(0, 64, (64, 17), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])


def _fsdp(compile: bool) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    model = build_model(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
    losses: list[float] = []

    def recorded(outputs, targets):
        value = loss(outputs, targets)
        losses.append(value.item())
        return value

    trainer = shoal.Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                            loss_fn=recorded, strategy="fsdp", batch_size=8, progress=False,
                            compile=compile, seed=SEED)
    trainer.fit(_tokens(), max_steps=STEPS)
    weights = {k: v.full_tensor().detach().clone()
               for k, v in trainer.module.state_dict().items()}
    return losses, weights, trainer.module


@pytest.mark.timeout(300)
def test_fsdp_compiles_each_block_before_sharding(single_process):
    eager_losses, eager_weights, _ = _fsdp(compile=False)
    losses, weights, module = _fsdp(compile=True)
    assert all(block._compiled_call_impl is not None for block in module.blocks)
    assert module._compiled_call_impl is None  # the root stays eager: FSDP's hooks run there
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    for key, value in weights.items():
        assert torch.allclose(value, eager_weights[key], rtol=0, atol=1e-4), key
