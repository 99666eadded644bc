"""Tiny transformers models built from their configs (random weights, nothing downloaded),
their data, and the single-process reference every shoal run is compared against."""

from __future__ import annotations

import pytest
import torch

from shoal.models.hf import HFModelConfig, build_model

transformers = pytest.importorskip(
    "transformers", reason="the transformers tests need shoal[hf] (the test extra has it)")

VOCAB, SEQ, N_SAMPLES, SEED = 64, 16, 48, 3
NO_DROPOUT = {"gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
              "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}
MODELS = {
    "gpt2": HFModelConfig(model_class="GPT2LMHeadModel", seed=SEED, config={
        "vocab_size": VOCAB, "n_positions": SEQ, "n_embd": 32, "n_layer": 2, "n_head": 2,
        "use_cache": False, "bos_token_id": 0, "eos_token_id": 0, **NO_DROPOUT["gpt2"]}),
    # Grouped-query attention (1 key/value head for 2 query heads), untied output head.
    "llama": HFModelConfig(model_class="LlamaForCausalLM", seed=SEED, config={
        "vocab_size": VOCAB, "max_position_embeddings": SEQ, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}),
    "bert": HFModelConfig(model_class="BertForMaskedLM", seed=SEED, config={
        "vocab_size": VOCAB, "max_position_embeddings": SEQ, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "pad_token_id": 0, **NO_DROPOUT["bert"]}),
}
LAYERS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "bert": "BertLayer"}


def token_ids(n: int = N_SAMPLES) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))


def samples(n: int = N_SAMPLES) -> list[dict[str, torch.Tensor]]:
    """Dict samples as a causal LM takes them (BERT's masked LM: every token a label)."""
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
            for ids in token_ids(n)]


def hf_dataset(n: int = N_SAMPLES):
    """The same samples as a ``datasets.Dataset``, built in memory, in torch format."""
    datasets = pytest.importorskip("datasets", reason="needs shoal[hf]")
    ids = token_ids(n).tolist()
    return datasets.Dataset.from_dict({
        "input_ids": ids, "attention_mask": [[1] * SEQ for _ in ids], "labels": ids,
    }).with_format("torch")


def make_model(name: str) -> torch.nn.Module:
    return build_model(MODELS[name])


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference(name: str, steps: int, global_batch: int) -> dict:
    """One process, a hand-written loop, the global batch, shoal's data order (randperm
    seeded with seed + epoch): the losses and the weights after ``steps`` steps."""
    data = samples()
    model = make_model(name)
    optimizer = make_optimizer(model)
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + epoch))
        for first in range(0, len(data), global_batch):
            batch = torch.utils.data.default_collate(
                [data[i] for i in order[first:first + global_batch]])
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) == steps:
                break
        epoch += 1
    return {"losses": losses,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
