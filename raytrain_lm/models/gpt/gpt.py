"""The GPT decoder (after nanoGPT and GPT-2): pre-LayerNorm blocks, learned positions, a tanh GELU
MLP, a fused q/k/v projection and an output head tied to the token embedding. It knows nothing of
distribution (nothing here imports torch.distributed): parallel/ applies it from outside.

The fused q/k/v projection `c_attn` uses Megatron's head-interleaved row order
([h0: q,k,v][h1: q,k,v]...), not GPT-2's [q; k; v]. A contiguous split of its rows (what
ColwiseParallel / Shard(0) does) then hands each tensor-parallel rank whole heads, and the forward
infers the number of heads from the local tensor. GPT-2's order converts both ways in hf_gpt.py
(same shapes: a checkpoint in the other order would load silently but be wrong).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_lm.models import attention, mup
from raytrain_lm.models.decoder import Decoder
from raytrain_lm.models.family import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.head_dim = cfg.n_embd // cfg.n_head
        self.scale = mup.attention_scale(cfg)  # None: SDPA's 1/sqrt(head_dim)
        # Rows in head-interleaved order: [h0 q, h0 k, h0 v, h1 q, ...], each head_dim rows long.
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: Optional[tuple] = None):
        B, T = x.shape[:2]
        # -1 heads: under tensor parallelism c_attn returns only this rank's heads.
        q, k, v = self.c_attn(x).view(B, T, -1, 3, self.head_dim).unbind(dim=3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        if cache is None and attention.current() is not None:  # outside set the keys
            y = attention.attend(q, k, v, dropout=self.dropout if self.training else 0.0, scale=self.scale)
            y = y.transpose(1, 2).reshape(B, T, -1)
            return self.resid_dropout(self.c_proj(y)), (k, v)
        if cache is not None:  # generation: attend to the cached prefix as well
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        # With a cache and one new token, the new query may see every cached key: not causal-masked.
        causal = cache is None or T > 1
        if cache is not None and T > 1 and k.size(2) != T:
            raise ValueError("a multi-token step is only supported on an empty cache")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)  # local heads * head_dim columns
        return self.resid_dropout(self.c_proj(y)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        # exact by default (as nanoGPT; cheaper on CPU); GPT-2's own weights need its tanh form
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: Optional[tuple] = None):
        a, kv = self.attn(self.ln_1(x), cache)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, kv


class GPT(Decoder):
    tied = True
    EMBED = ("wte", "wpe", "drop")

    def __init__(self, cfg: ModelConfig, seed: Optional[int] = None):
        super().__init__()
        assert cfg.vocab_size is not None, "vocab_size must be set (from the dataset) before building"
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        self._init_or_leave_meta(seed)

    def tie_weights(self) -> None:
        """Input and output embeddings share one tensor. `Module.to_empty` (meta -> real) unties
        plain tensors, so call this again after it."""
        self.lm_head.weight = self.wte.weight

    @staticmethod
    def init_spec(cfg: ModelConfig, module: nn.Module, fqn: str) -> tuple[str, float]:
        """GPT-2's initialisation of one parameter: ("normal", std), ("zeros", 0) or ("ones", 0)."""
        if isinstance(module, nn.LayerNorm):
            return ("ones", 0.0) if fqn.endswith("weight") else ("zeros", 0.0)
        if fqn.endswith("bias"):
            return ("zeros", 0.0)
        if fqn.endswith("c_proj.weight"):
            # scale the residual projections by 1/sqrt(2 * n_layer) so depth doesn't blow up the
            # residual stream's variance
            return ("normal", cfg.init_std / math.sqrt(2 * cfg.n_layer))
        if isinstance(module, (nn.Linear, nn.Embedding)):
            return ("normal", cfg.init_std)
        raise ValueError(f"no init rule for {fqn} ({type(module).__name__})")

    # The forward in three pieces (embed, the blocks, head), so that a pipeline stage
    # (parallel/pp.py) runs exactly this code on the part of the model it holds.
    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        pos = attention.positions(start, idx.size(1), idx.device)
        # wpe(pos) is (T, C) (or (B, T, C) with positions per sequence: document masking) and
        # broadcasts over the batch; under sequence parallelism both terms are this rank's slice
        # of the sequence.
        return self.drop(self.wte(idx) + self.wpe(pos))
