"""The decoder of the Llama family and of every family on its skeleton (Llama 2 and 3.x, Qwen2,
Qwen3, Mistral; after Meta's llama/model.py, transformers and torchtitan): RMSNorm before
attention and MLP, rotary position embeddings, grouped-query attention, a SwiGLU MLP. What the
families add are its settings (models/family.ModelConfig): q/k/v biases (`qkv_bias`, Qwen2),
an RMSNorm of each query and key head before the rotation (`qk_norm`, Qwen3), a sliding window
(`sliding_window`, Mistral), an output head tied to the embedding (`tie_embeddings`, Llama 3.2
1B/3B, small Qwens) and scaled rotary frequencies (`rope_type` linear or llama3). Like the GPT
it knows nothing of distribution (no torch.distributed), and it keeps the GPT's skeleton and
names where they mean the same thing (`wte`, the blocks `h`, `ln_1`/`ln_2`/`ln_f` for the
norms, `lm_head`), so the parallel/ code that splits, shards and pipelines the GPT does the
same here.

Choices that matter outside this file:

* q, k and v are three projections (not one fused matrix as in the GPT): a contiguous row split
  of each (ColwiseParallel) hands a tensor-parallel rank whole query heads and whole key/value
  heads, and the forward infers both head counts from the local tensors. With `n_kv_head`
  divisible by tp, query heads r*H/tp.. of rank r use exactly its key/value heads r*KV/tp..
  (query head i reads kv head i // (H/KV), as `repeat_interleave`).
* Rotary embeddings in Hugging Face's convention (rotate_half: the head dimension's two halves
  are the pairs), so `LlamaForCausalLM` weights load without permuting q and k. (Meta's
  checkpoints pair adjacent dimensions; transformers' conversion script permutes them once.)
* One `Rotary` module holds the cos/sin tables (buffers, not saved) for the positions the model
  has been asked for: the run's sequence length (`fit_positions`, before the model is
  compiled or wrapped), else grown to the next power of two, up to block_size, by the first
  forward that needs more (generation). A release's context (Mistral-Nemo: 1,024,000
  positions, 1 GB of tables at head size 128) is what it may attend to, not what a run of 4,096
  tokens needs. Every attention holds a reference to the module, so a pipeline stage that
  takes some blocks takes the tables with them; a KV-cached step reads the rows of its
  positions from the same tables (the cache's length is where the new tokens start).
* A sliding window needs no mask while every query's keys fit in it (the causal kernel is then
  exact). Past it, a whole window's forward (training, evaluation) attends by
  models/attention.sliding_window (a GPU's flex_attention block mask: a fused kernel); a KV-cached
  step by an explicit (queries x keys) mask (`window_mask`), both of attention.mask_rule.
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


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """theta^(-2j/head_dim) for j < head_dim/2 (fp32, on the CPU), scaled by cfg.rope_type as
    transformers' modeling_rope_utils computes it: linear divides every frequency by the factor;
    llama3 (Llama 3.1+) divides those whose wavelength exceeds original_context /
    low_freq_factor, keeps those below original_context / high_freq_factor, and blends the band
    between."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu")
                                         .float() / d))
    factor = cfg.rope_factor
    if cfg.rope_type == "linear":
        return inv_freq / factor
    if cfg.rope_type != "llama3":
        return inv_freq
    context = cfg.rope_original_context or cfg.block_size
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(cfg: ModelConfig, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (rows, head_dim) in fp32 on the CPU: position p, dimension j holds
    p * inv_freq[j mod head_dim/2], the same products transformers computes."""
    inv_freq = inverse_frequencies(cfg)
    positions = torch.arange(rows, dtype=torch.int64, device="cpu").float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Rotary(nn.Module):
    """The rotary tables (buffers, recomputed rather than saved: `reset_buffers`), for the
    positions asked for so far (the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(0, cfg.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(0, cfg.head_dim), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The tables recomputed at their size (after a meta-device build: on the CPU)."""
        self._fill(self.cos.size(0), torch.device("cpu") if self.cos.is_meta else self.cos.device)

    def fit_positions(self, n: int) -> None:
        """Tables for positions 0..n-1 (n at most block_size), exactly: the run's sequence."""
        if n != self.cos.size(0):
            self._fill(min(n, self.cfg.block_size), self.cos.device)

    def rows(self, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions start..start+T-1, the tables grown first where they end
        before (to the next power of two, at most block_size: a generation grows them a few
        times, not once per token)."""
        end = start + T
        if end > self.cos.size(0):
            self._fill(min(1 << (end - 1).bit_length(), self.cfg.block_size), self.cos.device)
        return self.cos[start:end], self.sin[start:end]

    @torch.no_grad()
    def _fill(self, rows: int, device: torch.device) -> None:
        cos, sin = rotary_tables(self.cfg, rows)
        self.cos, self.sin = cos.to(device), sin.to(device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); cos, sin: (T, head_dim) or, a position per token of each
    sequence, (B, T, head_dim) rows of its positions."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rotary):
        super().__init__()
        self.head_dim, self.window = cfg.head_dim, cfg.sliding_window
        self.scale = mup.attention_scale(cfg)  # None: SDPA's 1/sqrt(head_dim)
        q, kv = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, q, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.n_embd, kv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.n_embd, kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.n_embd, bias=False)
        if cfg.qk_norm:  # Qwen3: each head of q and k normalised before the rotation
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.rope = rope  # shared by every block (see the module docstring)

    def forward(self, x: torch.Tensor, cache: Optional[tuple] = None):
        B, T = x.shape[:2]
        # -1 heads: under tensor parallelism each projection returns only this rank's heads.
        q, k, v = (proj(x).view(B, T, -1, self.head_dim) for proj in (self.q_proj, self.k_proj,
                                                                       self.v_proj))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        start = 0 if cache is None else cache[0].size(2)
        span = attention.current() if cache is None else None
        if span is not None:  # outside set the positions and the keys (models/attention.py)
            cos, sin = self.rope.rows(0, span.keys.numel())  # positions lie below the window's length
            cos, sin = attention.rows(span, cos, "cos"), attention.rows(span, sin, "sin")
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            y = attention.attend(q, k, v, self.window, scale=self.scale)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1)), (k, v)
        cos, sin = self.rope.rows(start, T)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:  # generation: the cache holds rotated keys, one per kv head
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        if cache is not None and T > 1 and k.size(2) != T:
            raise ValueError("a multi-token step is only supported on an empty cache")
        gqa = q.size(1) != k.size(1)
        if cache is None and self.window is not None and T > self.window:  # a whole window past it
            y = attention.sliding_window(q, k, v, self.window, scale=self.scale)
        elif self.window is not None and k.size(2) > self.window:  # some query sees past its window
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(start, T, k.size(2),
                                                                              self.window, q.device),
                                               enable_gqa=gqa, scale=self.scale)
        else:  # one new token may see every cached key
            y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None or T > 1,
                                               enable_gqa=gqa, scale=self.scale)
        y = y.transpose(1, 2).reshape(B, T, -1)  # local heads * head_dim columns
        return self.o_proj(y), (k, v)


def window_mask(start: int, T: int, keys: int, window: int, device) -> torch.Tensor:
    """(T, keys) booleans: query at position start + i sees key j where j <= start + i and
    start + i - j < window (transformers' sliding_window_overlay on its causal mask)."""
    q = torch.arange(start, start + T, device=device)[:, None]
    return attention.mask_rule(q, torch.arange(keys, device=device)[None, :], window)


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
        self.tied = cfg.tie_embeddings
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.rope = Rotary(cfg)
        self.h = nn.ModuleList(self.Block(cfg, self.rope) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        self._init_or_leave_meta(seed)

    def tie_weights(self) -> None:
        """A tied head shares the embedding's one tensor (again after `Module.to_empty`)."""
        if self.tied:
            self.lm_head.weight = self.wte.weight

    @staticmethod
    def init_spec(cfg: ModelConfig, module: nn.Module, fqn: str) -> tuple[str, float]:
        """GPT-2's scheme carried over: N(0, 0.02) for matrices and the embedding, the residual
        projections (o_proj, down_proj) scaled by 1/sqrt(2 n_layer), norms at one, biases at
        zero."""
        if isinstance(module, RMSNorm):
            return ("ones", 0.0)
        if fqn.endswith(".bias"):
            return ("zeros", 0.0)
        if fqn.endswith(("o_proj.weight", "down_proj.weight")):
            return ("normal", cfg.init_std / math.sqrt(2 * cfg.n_layer))
        if isinstance(module, (nn.Linear, nn.Embedding)):
            return ("normal", cfg.init_std)
        raise ValueError(f"no init rule for {fqn} ({type(module).__name__})")
