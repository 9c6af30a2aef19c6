"""The Llama family's decoder (Llama 2 and 3, after Meta's llama/model.py and torchtitan): RMSNorm
before attention and MLP, rotary position embeddings, grouped-query attention, a SwiGLU MLP, no
biases, an untied output head. Like the GPT it knows nothing of distribution (no
torch.distributed), and it keeps the GPT's skeleton and names where they mean the same thing
(`wte`, the blocks `h`, `ln_1`/`ln_2`/`ln_f` for the norms, `lm_head`), so the parallel/ code
that splits, shards and pipelines the GPT does the same here.

Choices that matter outside this file:

* q, k and v are three projections (not one fused matrix as in the GPT): a contiguous row split
  of each (ColwiseParallel) hands a tensor-parallel rank whole query heads and whole key/value
  heads, and the forward infers both head counts from the local tensors. With `n_kv_head`
  divisible by tp, query heads r*H/tp.. of rank r use exactly its key/value heads r*KV/tp..
  (query head i reads kv head i // (H/KV), as `repeat_interleave`).
* Rotary embeddings in Hugging Face's convention (rotate_half: the head dimension's two halves
  are the pairs), so `LlamaForCausalLM` weights load without permuting q and k. (Meta's
  checkpoints pair adjacent dimensions; transformers' conversion script permutes them once.)
* One `Rotary` module holds the cos/sin tables for positions 0..block_size-1 (buffers, not
  saved). Every attention holds a reference to it, so a pipeline stage that takes some blocks
  takes the tables with them; a KV-cached step reads the rows of its positions from the same
  tables (the cache's length is where the new tokens start).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_lm.models.decoder import Decoder
from raytrain_lm.models.family import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def rotary_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (length, head_dim) in fp32 on the CPU: position p, dimension j holds
    p * theta^(-2(j mod head_dim/2)/head_dim), the same products transformers computes."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
                                .float() / head_dim))
    freqs = torch.arange(length, dtype=torch.int64, device="cpu").float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Rotary(nn.Module):
    """The rotary tables (buffers, recomputed rather than saved: `reset_buffers`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.length, self.theta = cfg.head_dim, cfg.block_size, cfg.rope_theta
        self.register_buffer("cos", torch.empty(self.length, self.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(self.length, self.head_dim), persistent=False)
        if not self.cos.is_meta:
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        cos, sin = rotary_tables(self.head_dim, self.length, self.theta)
        if self.cos.is_meta:  # built on the meta device and loaded from a state dict
            self.cos, self.sin = cos, sin
        else:
            self.cos.copy_(cos)
            self.sin.copy_(sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); cos, sin: (T, head_dim) rows of its positions."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rotary):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.rope = rope  # shared by every block (see the module docstring)

    def forward(self, x: torch.Tensor, cache: Optional[tuple] = None):
        B, T = x.shape[:2]
        # -1 heads: under tensor parallelism each projection returns only this rank's heads.
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # (B, heads, T, head_dim)
        start = 0 if cache is None else cache[0].size(2)
        cos, sin = self.rope.cos[start:start + T], self.rope.sin[start:start + T]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:  # generation: the cache holds rotated keys, one per kv head
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        causal = cache is None or T > 1  # one new token may see every cached key
        if cache is not None and T > 1 and k.size(2) != T:
            raise ValueError("a multi-token step is only supported on an empty cache")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                           enable_gqa=q.size(1) != k.size(1))
        y = y.transpose(1, 2).reshape(B, T, -1)  # local heads * head_dim columns
        return self.o_proj(y), (k, v)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), of `hidden` units (default: the config's)."""

    def __init__(self, cfg: ModelConfig, hidden: Optional[int] = None):
        super().__init__()
        hidden = hidden or cfg.hidden_dim
        self.gate_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then + mlp(norm(x)). Called as the GPT's Block is.
    `MLP`: its feed-forward module's class (a mixture of experts: models/moe/)."""

    MLP = SwiGLU

    def __init__(self, cfg: ModelConfig, rope: Rotary):
        super().__init__()
        self.ln_1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg, rope)
        self.ln_2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = self.MLP(cfg)

    def forward(self, x: torch.Tensor, cache: Optional[tuple] = None):
        a, kv = self.attn(self.ln_1(x), cache)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, kv


class Llama(Decoder):
    Block = LlamaBlock

    def __init__(self, cfg: ModelConfig, seed: Optional[int] = None):
        super().__init__()
        assert cfg.vocab_size is not None, "vocab_size must be set (from the dataset) before building"
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.rope = Rotary(cfg)
        self.h = nn.ModuleList(self.Block(cfg, self.rope) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self._init_or_leave_meta(seed)

    @staticmethod
    def init_spec(cfg: ModelConfig, module: nn.Module, fqn: str) -> tuple[str, float]:
        """GPT-2's scheme carried over: N(0, 0.02) for matrices and the embedding, the residual
        projections (o_proj, down_proj) scaled by 1/sqrt(2 n_layer), norms at one."""
        if isinstance(module, RMSNorm):
            return ("ones", 0.0)
        if fqn.endswith(("o_proj.weight", "down_proj.weight")):
            return ("normal", 0.02 / math.sqrt(2 * cfg.n_layer))
        if isinstance(module, (nn.Linear, nn.Embedding)):
            return ("normal", 0.02)
        raise ValueError(f"no init rule for {fqn} ({type(module).__name__})")
