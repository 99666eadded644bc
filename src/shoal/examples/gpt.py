"""A small GPT: byte-level, pre-norm, causal, in one file that reads top to bottom.

The model is the common target of shoal's sharded and model-parallel strategies, so its
structure and attribute names are a contract:

- ``GPT.tok_emb``, ``GPT.pos_emb``, ``GPT.blocks`` (a ModuleList of ``Block``), ``GPT.norm``,
  ``GPT.head``; ``forward = logits(run_blocks(embed(idx)))``, and each piece works alone, so
  a pipeline stage can hold the embeddings, a slice of the blocks, or the output head.
- ``Block.norm1``, ``Block.attn``, ``Block.norm2``, ``Block.mlp``: one unit for FSDP wrapping
  and activation checkpointing.
- ``CausalSelfAttention.q/k/v/proj`` and ``MLP.fc/proj`` are plain Linear layers, the usual
  column-wise / row-wise pairs of tensor parallelism. Attention infers the number of heads
  from the width of its input (``view(B, T, -1, head_dim)``): a tensor-parallel rank holds
  only its share of the heads.

The output head is not tied to the token embedding: a tied weight would sit on two pipeline
stages and in two shardings at once.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn


class GPTConfig(BaseModel):
    """The shape of a GPT; validated when built, so a bad shape fails before any process."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    vocab_size: int = Field(256, gt=0)
    """Token ids are 0..vocab_size-1; 256 for bytes, so no tokenizer is needed."""
    seq_len: int = Field(128, gt=0)
    """Longest sequence the model reads (rows of the position embedding)."""
    n_layer: int = Field(4, gt=0)
    """Transformer blocks; the unit of pipeline splits and FSDP wrapping."""
    n_head: int = Field(4, gt=0)
    """Attention heads per block; tensor parallelism splits them across ranks."""
    d_model: int = Field(128, gt=0)
    """Width of the residual stream; a multiple of n_head."""
    mlp_ratio: int = Field(4, gt=0)
    """Width of the MLP's hidden layer, in multiples of d_model."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on attention weights and residual branches (0: deterministic training)."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head "
                             f"({self.n_head}): each head gets d_model / n_head features")
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t sees positions <= t only."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.d_model
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1, not n_head: under tensor parallelism q/k/v give only this rank's heads.
        q, k, v = (f(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))


class MLP(nn.Module):
    """Position-wise feed-forward layer: widen, GELU, project back."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: the residual stream is never normalised in place."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token ids (B, T) to next-token logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.seed = 0
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter with ``init_parameter`` (``seed`` replaces
        ``self.seed``). Callable again after ``to_empty``."""
        self.seed = self.seed if seed is None else seed
        for name, param in self.named_parameters():
            self.init_parameter(name, param)

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` with the initial value of the parameter ``name``, whole.

        GPT-2's init: N(0, 0.02) weights, zero biases, unit norms; the projections into the
        residual stream scaled by 1/sqrt(2 n_layer), so its variance does not grow with
        depth. Each weight draws from its own generator, seeded by (seed, name): the value
        does not depend on which other parameters exist or in which order they are made,
        so a rank holding a piece of the model (a shard, a pipeline stage) can compute
        the whole parameter and keep its piece (``shoal.Harness`` does, for a model built
        on the meta device).
        """
        if tensor.is_meta:
            return  # nothing to fill yet: see build_model(device="meta")
        if name.endswith("bias"):
            tensor.zero_()
        elif name == "norm.weight" or name.endswith((".norm1.weight", ".norm2.weight")):
            tensor.fill_(1.0)
        else:
            std = 0.02 / math.sqrt(2 * self.config.n_layer) \
                if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else 0.02
            # Drawn on the CPU: the same values whatever device the model is on.
            generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
            tensor.copy_(torch.empty(tensor.shape, dtype=tensor.dtype)
                         .normal_(0.0, std, generator=generator))

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings: (B, T) ids to (B, T, d_model)."""
        T = idx.shape[1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len "
                             f"({self.config.seq_len})")
        positions = torch.arange(T, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: (B, T, d_model) to (B, T, vocab_size)."""
        return self.head(self.norm(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.logits(self.run_blocks(self.embed(idx)))

    def flops_per_token(self) -> float:
        """Training FLOPs (forward and backward) per token at full sequence length, for
        MFU: 6 per weight of every matrix product (the embeddings are lookups) plus
        attention's scores and weighted sum, 12 x layers x d_model x seq_len."""
        c = self.config
        lookups = (c.vocab_size + c.seq_len) * c.d_model
        return 6 * (parameter_count(c) - lookups) + 12 * c.n_layer * c.d_model * c.seq_len


def build_model(vocab_size: int = 256, seq_len: int = 128, n_layer: int = 4, n_head: int = 4,
                d_model: int = 128, mlp_ratio: int = 4, dropout: float = 0.0,
                seed: int = 0, device: str = "cpu") -> GPT:
    """A GPT whose weights depend on ``seed`` only; the global RNG is left untouched.

    Built on the meta device and initialised once from private generators, which also
    saves initialising a large model twice. ``device="meta"``: left there, to be split
    over ranks before its weights exist (``shoal.Harness`` initialises each rank's part).
    """
    config = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head,
                       d_model=d_model, mlp_ratio=mlp_ratio, dropout=dropout)
    with torch.device("meta"):
        model = GPT(config)
    model.seed = seed
    if device != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def count_parameters(model: nn.Module) -> int:
    """Parameters of any module (works on the meta device, so large models cost nothing)."""
    return sum(p.numel() for p in model.parameters())


def parameter_count(config: GPTConfig) -> int:
    """Parameters of ``GPT(config)``, without building it.

    Per block: q, k, v, proj (4 d^2 + 4 d), the MLP (2 r d^2 + r d + d), two norms (4 d).
    Defaults (4 layers, d_model 128, seq_len 128): 875,264.
    """
    d, r = config.d_model, config.mlp_ratio
    block = (4 + 2 * r) * d * d + (9 + r) * d
    embeddings = (config.vocab_size + config.seq_len) * d
    return embeddings + config.n_layer * block + 2 * d + d * config.vocab_size


# For the memory benchmark of the sharded strategies: 57,294,336 parameters
# (8 layers, d_model 768, 12 heads, seq_len 256, vocab 256), about 229 MB in fp32 and
# 917 MB with gradients and AdamW's two moments.
GPT_57M = GPTConfig(n_layer=8, d_model=768, n_head=12, seq_len=256)


def config_for_parameters(target: int, *, d_model: int = 768, n_head: int = 12,
                          seq_len: int = 256, vocab_size: int = 256) -> GPTConfig:
    """The fewest layers of the given width with at least ``target`` parameters.

    ``config_for_parameters(50_000_000)`` has 7 layers and 50,206,464 parameters.
    """
    config = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=1, n_head=n_head,
                       d_model=d_model)
    per_layer = parameter_count(config.model_copy(update={"n_layer": 2})) \
        - parameter_count(config)
    layers = max(1, math.ceil((target - parameter_count(config)) / per_layer) + 1)
    return config.model_copy(update={"n_layer": layers})


def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of every sequence."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def build_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss for a run config's ``loss:`` section."""
    return loss
