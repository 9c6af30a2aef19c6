"""A GPT decoder in one file (after nanoGPT). It knows nothing of distribution: DDP, FSDP, tensor and
pipeline parallelism, activation checkpointing and compile are applied from outside (`parallel/`).
Nothing here imports torch.distributed.

Two things in this file exist so that it *can* be distributed from outside:

* The fused q/k/v projection `c_attn` uses Megatron's head-interleaved row order
  ([h0: q,k,v][h1: q,k,v]...), not GPT-2's [q; k; v]. A contiguous split of its rows (what
  ColwiseParallel / Shard(0) does) then hands each tensor-parallel rank whole heads, and the
  forward infers the number of heads from the local tensor. Checkpoints in GPT-2's layout must be
  converted with `qkv_gpt2_to_interleaved` (same shapes: they would load silently but be wrong).
* Initialisation is defined per parameter *region*, not by a global RNG stream: the values of rows
  [r0, r1) of parameter `wte.weight` depend only on (seed, name, row block), so any shard of any
  layout can be filled on its own and the result equals the single-process build (`init_region_`).

`Decoder` is what both architectures share (the forward in three pieces, the KV cache, building
from a state dict, initialisation); `GPT` here and `Llama` in llama.py fill it in. `architecture`
maps `ModelConfig.arch` to the class.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_lm.config.settings import ModelConfig


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, one (k, v) pair per layer, for fast sampling."""

    layers: list

    @property
    def length(self) -> int:
        return 0 if not self.layers or self.layers[0] is None else self.layers[0][0].size(2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.head_dim = cfg.n_embd // cfg.n_head
        # Rows in head-interleaved order: [h0 q, h0 k, h0 v, h1 q, ...], each head_dim rows long.
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: Optional[tuple] = None):
        B, T = x.shape[:2]
        # -1 heads: under tensor parallelism c_attn returns only this rank's heads.
        q, k, v = self.c_attn(x).view(B, T, -1, 3, self.head_dim).unbind(dim=3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        if cache is not None:  # generation: attend to the cached prefix as well
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        # With a cache and one new token, the new query may see every cached key: not causal-masked.
        causal = cache is None or T > 1
        if cache is not None and T > 1 and k.size(2) != T:
            raise ValueError("a multi-token step is only supported on an empty cache")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)  # local heads * head_dim columns
        return self.resid_dropout(self.c_proj(y)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


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


class Decoder(nn.Module):
    """token ids -> `embed` -> the blocks `h` -> `head` -> logits. Subclasses build wte, h, ln_f,
    lm_head (and what `embed` needs) in __init__, then call `_init_or_leave_meta`."""

    tied = False  # whether lm_head shares wte's weight (a pipeline's last stage then holds a copy)
    EMBED = ("wte",)  # the modules `embed` uses (a pipeline's first stage holds them)
    HEAD = ("ln_f", "lm_head")  # the modules `head` uses (the last stage holds them)

    def _init_or_leave_meta(self, seed: Optional[int]) -> None:
        """Built under `torch.device("meta")` the parameters stay uninitialised (to be sharded,
        materialised with `to_empty` and filled by `init_weights` or its sharded counterpart).
        Otherwise they are initialised with `seed`, by default `torch.initial_seed()` (the value
        of the last `torch.manual_seed`)."""
        if not self.wte.weight.is_meta:
            self.init_weights(torch.initial_seed() if seed is None else seed)

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state: dict) -> "Decoder":
        """A model holding exactly `state` (every weight, strictly), without computing initial
        values that would be overwritten."""
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(state, assign=True)
        model.tie_weights()
        fill_buffers_(model)  # what a state dict does not hold (Llama's rotary tables)
        return model

    def tie_weights(self) -> None:
        """Point tied parameters at one tensor again (`Module.to_empty` unties plain tensors)."""

    @staticmethod
    def init_spec(cfg: ModelConfig, module: nn.Module, fqn: str) -> tuple[str, float]:
        raise NotImplementedError

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every (full, unsharded) parameter with its layout-independent initial values."""
        for fqn, module, pname, p in init_targets(self):
            init_region_(p, fqn, self.init_spec(self.cfg, module, fqn), p.shape, (0,) * p.dim(), seed)

    def num_params(self, exclude_position: bool = False) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    def matmul_params(self) -> int:
        """The N of 6N FLOPs per token: the parameters used in matrix multiplies."""
        raise NotImplementedError

    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.wte(idx)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None):
        """Returns (logits, loss). With targets, loss is the mean next-token cross-entropy.
        With a cache, `idx` continues the cached sequence and the cache is extended in place."""
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.cfg.block_size}")
        x = self.embed(idx, start)
        for i, block in enumerate(self.h):
            layer_cache = cache.layers[i] if cache is not None else None
            x, kv = block(x, layer_cache)
            if cache is not None:
                cache.layers[i] = kv
        if targets is None:
            return self.head(x[:, -1:, :]), None  # only the last position is needed to sample
        logits = self.head(x)
        # Under tensor parallelism with loss parallelism, logits is a DTensor sharded over the
        # vocabulary; cross_entropy then runs on the shards inside `loss_parallel()`.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))
        return logits, loss

    def new_cache(self) -> KVCache:
        return KVCache(layers=[None] * self.cfg.n_layer)


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
        return init_spec(cfg, module, fqn)

    def num_params(self, exclude_position: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        return n - self.wpe.weight.numel() if exclude_position else n

    def matmul_params(self) -> int:
        return self.num_params(exclude_position=True)  # the tied wte counts once, as the head

    # The forward in three pieces (embed, the blocks, head), so that a pipeline stage
    # (parallel/pp.py) runs exactly this code on the part of the model it holds.
    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        pos = torch.arange(start, start + idx.size(1), device=idx.device)
        # wpe(pos) is (T, C) and broadcasts over the batch; under sequence parallelism both terms
        # are this rank's slice of the sequence.
        return self.drop(self.wte(idx) + self.wpe(pos))


def architecture(cfg: ModelConfig) -> type[Decoder]:
    """The decoder class of `cfg.arch`."""
    from raytrain_lm.models.llama.llama import Llama  # llama.py builds on this module

    return {"gpt": GPT, "llama": Llama}[cfg.arch]


def build_model(cfg: ModelConfig, seed: Optional[int] = None) -> Decoder:
    return architecture(cfg)(cfg, seed=seed)


def fill_buffers_(model: nn.Module) -> None:
    """Compute the buffers a state dict does not hold (non-persistent: Llama's rotary tables),
    after a meta-device build or `to_empty`."""
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()


# ---------------------------------------------------------------------------------------------
# Layout-independent initialisation.
#
# Each parameter is seen as a 2-D matrix (rows = dim 0, cols = the rest). Its rows are cut into
# blocks of `block_rows(shape)` rows, and block b is drawn from its own generator, seeded by
# hash(seed, parameter name, b). A shard that holds rows [r0, r1) and columns [c0, c1) draws only
# the blocks that overlap its rows and keeps its columns: no rank ever holds more than its shard
# plus one block (INIT_BLOCK_ELEMS floats), and every layout sees the same numbers.
# ---------------------------------------------------------------------------------------------

INIT_BLOCK_ELEMS = 1 << 18  # 1 MiB of float32 per RNG block


def block_rows(shape: Sequence[int]) -> int:
    cols = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, INIT_BLOCK_ELEMS // cols)


def init_device(device: torch.device) -> torch.device:
    """Where a parameter's initial values are drawn: on its own device (a GPU draws and scales
    its blocks itself: no host generator, no copy per block), on the CPU for CPU and meta
    tensors. A block's values depend on the device's generator: a GPU run starts from other
    values than a CPU run with the same seed, and all layouts on one GPU model from the same."""
    return device if device.type not in ("cpu", "meta") else torch.device("cpu")


def _block_generator(seed: int, name: str, block: int, device: torch.device) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


def init_spec(cfg: ModelConfig, module: nn.Module, fqn: str) -> tuple[str, float]:
    """GPT-2's initialisation of one parameter: ("normal", std), ("zeros", 0) or ("ones", 0)."""
    if isinstance(module, nn.LayerNorm):
        return ("ones", 0.0) if fqn.endswith("weight") else ("zeros", 0.0)
    if fqn.endswith("bias"):
        return ("zeros", 0.0)
    if fqn.endswith("c_proj.weight"):
        # scale the residual projections by 1/sqrt(2 * n_layer) so depth doesn't blow up the
        # residual stream's variance
        return ("normal", 0.02 / math.sqrt(2 * cfg.n_layer))
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return ("normal", 0.02)
    raise ValueError(f"no init rule for {fqn} ({type(module).__name__})")


def init_targets(model: nn.Module):
    """(fqn, owning module, param name, param) for every parameter, each shared one once, named
    by its first owner (so the tied lm_head is initialised as wte.weight)."""
    seen = set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{mname}.{pname}" if mname else pname), module, pname, p


@torch.no_grad()
def init_region_(out: torch.Tensor, name: str, spec: tuple[str, float], global_shape: Sequence[int],
                 offset: Sequence[int], seed: int) -> None:
    """Fill `out` with the values of the parameter region that starts at `offset` (one index per
    dim) in a parameter of `global_shape`. `out` is a plain tensor (a full parameter or the local
    shard of a sharded one)."""
    kind, std = spec
    if kind == "zeros":
        out.zero_()
        return
    if kind == "ones":
        out.fill_(1.0)
        return
    if len(global_shape) > 2:
        raise NotImplementedError("region init covers 1-D and 2-D parameters")
    n_rows = global_shape[0]
    n_cols = global_shape[1] if len(global_shape) == 2 else 1
    r0, r1 = offset[0], offset[0] + out.shape[0]
    c0 = offset[1] if len(global_shape) == 2 else 0
    c1 = c0 + (out.shape[1] if len(global_shape) == 2 else 1)
    out2d = out.view(out.shape[0], -1)
    rows_per_block = block_rows(global_shape)
    device = init_device(out.device)
    for b in range(r0 // rows_per_block, (r1 - 1) // rows_per_block + 1 if r1 > r0 else 0):
        b0, b1 = b * rows_per_block, min((b + 1) * rows_per_block, n_rows)
        block = torch.randn(b1 - b0, n_cols, device=device,
                            generator=_block_generator(seed, name, b, device))
        lo, hi = max(b0, r0), min(b1, r1)
        out2d[lo - r0:hi - r0].copy_(block[lo - b0:hi - b0, c0:c1].mul_(std))


def qkv_gpt2_to_interleaved(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Convert a c_attn weight (3C, C) or bias (3C,) from GPT-2's [q; k; v] row order to the
    head-interleaved order used here (for old checkpoints and GPT-2 weights)."""
    three_c = t.shape[0]
    hd = three_c // (3 * n_head)
    return t.reshape(3, n_head, hd, *t.shape[1:]).transpose(0, 1).reshape(three_c, *t.shape[1:])


def qkv_interleaved_to_gpt2(t: torch.Tensor, n_head: int) -> torch.Tensor:
    three_c = t.shape[0]
    hd = three_c // (3 * n_head)
    return t.reshape(n_head, 3, hd, *t.shape[1:]).transpose(0, 1).reshape(three_c, *t.shape[1:])


def flops_per_token(cfg: ModelConfig, num_params_matmul: int, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6N + 12·L·H·Q·T.

    N counts the parameters used in matrix multiplies (`Decoder.matmul_params`: GPT: all but the
    position embeddings, the tied token embedding counting once, as the output projection; Llama:
    all but the token embedding, a lookup). L layers, H (query) heads, Q head size,
    T sequence length: the 12·L·H·Q·T term is attention's QK^T and AV products (forward + backward).
    """
    L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, seq_len
    return 6.0 * num_params_matmul + 12.0 * L * H * Q * T
