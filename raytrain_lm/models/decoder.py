"""The decoder skeleton every family builds on (after nanoGPT): token ids -> `embed` -> the blocks
`h` -> `head` -> logits, a KV cache for sampling, building from a state dict, and initialisation.
It knows nothing of distribution: DDP, FSDP, tensor and pipeline parallelism, activation
checkpointing and compile are applied from outside (`parallel/`). Nothing here imports
torch.distributed.

Initialisation is defined per parameter *region*, not by a global RNG stream: the values of rows
[r0, r1) of parameter `wte.weight` depend only on (seed, name, row block), so any shard of any
layout can be filled on its own and the result equals the single-process build (`init_region_`).
A family gives each parameter its rule (`init_spec`); the counts of its parameters and FLOPs are
its Family's (models/family.py), not a module's.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_lm.models import mup
from raytrain_lm.models.family import ModelConfig


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, one (k, v) pair per layer, for fast sampling."""

    layers: list

    @property
    def length(self) -> int:
        return 0 if not self.layers or self.layers[0] is None else self.layers[0][0].size(2)


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

    @classmethod
    def param_init_spec(cls, cfg: ModelConfig, module: nn.Module, fqn: str) -> tuple[str, float]:
        """The family's `init_spec` under the config's parametrization (models/mup.py)."""
        return mup.init_spec(cfg, fqn, cls.init_spec(cfg, module, fqn))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every (full, unsharded) parameter with its layout-independent initial values."""
        for fqn, module, pname, p in init_targets(self):
            init_region_(p, fqn, self.param_init_spec(self.cfg, module, fqn), p.shape,
                         (0,) * p.dim(), seed)

    def num_params(self) -> int:
        """The parameters this module holds, each tied one once (a measurement: the count is
        the Family's)."""
        return sum(p.numel() for p in self.parameters())

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
        aux = take_aux_losses(self.h) if self.training else None
        if targets is None:
            return self.head(x[:, -1:, :]), None  # only the last position is needed to sample
        logits = self.head(x)
        # Under tensor parallelism with loss parallelism, logits is a DTensor sharded over the
        # vocabulary; cross_entropy then runs on the shards inside `loss_parallel()`.
        # at least float32 (bf16/fp16 logits go up; a float64 model, as the tests' references
        # run, keeps float64)
        loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32))
                               .flatten(0, 1), targets.reshape(-1))
        # trained on, not reported: the loss's value stays the cross-entropy
        return logits, attach_aux_loss(loss, aux)

    def new_cache(self) -> KVCache:
        return KVCache(layers=[None] * self.cfg.n_layer)


def take_aux_losses(module: nn.Module) -> Optional[torch.Tensor]:
    """The sum of the auxiliary losses the modules under `module` computed in their last training
    forward (a mixture of experts' load balancing: `take_aux_loss`), each taken once; None where
    there are none. The caller makes them part of what backward differentiates
    (`attach_aux_loss`): the decoder to its loss, a pipeline stage to its output."""
    total = None
    for m in module.modules():
        take = getattr(m, "take_aux_loss", None)
        aux = take() if take is not None else None
        if aux is not None:
            total = aux if total is None else total + aux
    return total


class _AuxGradient(torch.autograd.Function):
    """x unchanged; in backward `aux` receives x's own gradient where x is the loss (a scalar),
    else a gradient of 1."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.loss, ctx.aux = x.dim() == 0, (aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.aux
        if ctx.loss:  # the loss's own gradient (accumulation's 1/n, fp16's scale), plain
            return grad, (grad.to_local() if hasattr(grad, "to_local") else grad).to(dtype)
        return grad, torch.ones((), dtype=dtype, device=device)


def attach_aux_loss(x: torch.Tensor, aux: Optional[torch.Tensor]) -> torch.Tensor:
    """`x` unchanged in value, with `aux` trained on as part of the loss when backward passes
    through `x`. `x` the loss itself (a scalar; under loss parallelism a distributed one): `aux`
    gets the gradient the loss gets. `x` a pipeline stage's output, the loss taken on another
    stage: per microbatch a gradient of 1 (the schedule divides every gradient by the
    microbatches afterwards, as it does the loss's)."""
    return x if aux is None else _AuxGradient.apply(x, aux)


def fit_positions_(model: nn.Module, n: int) -> None:
    """Size what a model keeps per position (Llama's rotary tables) to sequences of `n` tokens,
    the run's, before it is compiled or wrapped (a longer forward grows them: generation)."""
    for module in model.modules():
        if hasattr(module, "fit_positions"):
            module.fit_positions(n)


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
    shard of a sharded one). Spec ("normal_zero_q", std, head_dim): a fused qkv's normal draws
    with its query rows (rows r with (r // head_dim) % 3 == 0) zero."""
    kind, std = spec[:2]
    if kind == "zeros":
        out.zero_()
        return
    if kind in ("ones", "fill"):  # fill: the value `std` (a muP-scaled norm gain)
        out.fill_(1.0 if kind == "ones" else std)
        return
    if len(global_shape) > 2:  # (experts, out, in): regions that split dim 0 only
        if tuple(out.shape[1:]) != tuple(global_shape[1:]) or any(offset[1:]):
            raise NotImplementedError("region init splits parameters of 3 or more dims by rows only")
        global_shape = (global_shape[0], math.prod(global_shape[1:]))
        offset, out = (offset[0], 0), out.view(out.shape[0], -1)
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
    if kind == "normal_zero_q":
        rows = torch.arange(r0, r1, device=out2d.device)
        out2d[(rows // spec[2]) % 3 == 0] = 0.0
