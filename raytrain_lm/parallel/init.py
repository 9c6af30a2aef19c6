"""Build sharded: construct on the meta device, shard (TP, FSDP, pipeline split), then allocate
only the local shards (`to_empty`) and fill them with the layout-independent initial values
defined in models/decoder.py (`init_region_`). No rank ever materialises a full parameter it does not own.

Why not DTensor's own random init (nn.init.normal_ on a DTensor)? Its RNG is tied to the layout
(offset-based Philox on CUDA) and it is not supported on CPU meshes in this torch; and the values
would still differ from a single-process `torch.manual_seed` build. Here a parameter's values are a
pure function of (seed, FQN, row block), so any layout reproduces the single-process weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from raytrain_lm.models import decoder_class
from raytrain_lm.models.decoder import fill_buffers_, init_region_, init_targets


def local_region(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local tensor, global offset of its first element) for a parameter; works for Shard,
    Replicate and FSDP2+TP's _StridedShard placements, whose local shards are contiguous blocks
    of the global tensor (the same computation DCP uses to address checkpoint chunks)."""
    if not isinstance(p, DTensor):
        return p, (0,) * p.dim()
    local = p.to_local()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} != computed {shape} for "
                           f"{p.placements}")
    return local, tuple(offset)


@torch.no_grad()
def init_sharded_(model: nn.Module, cfg, seed: int) -> int:
    """Fill the local shard of every parameter of `model` (a decoder or a pipeline stage of one,
    sharded or not).
    Returns the number of elements this rank filled (for tests: sum of local shards)."""
    filled, spec = 0, decoder_class(cfg).param_init_spec
    for fqn, module, _, p in init_targets(model):
        local, offset = local_region(p)
        init_region_(local, fqn, spec(cfg, module, fqn), p.shape, offset, seed)
        filled += local.numel()
    return filled


def materialize_(model: nn.Module, cfg, seed: int, device: str | torch.device = "cpu",
                 init: bool = True) -> None:
    """meta -> real local shards -> initial values (`init`; else left as allocated, for weights
    loaded next) and the buffers no checkpoint holds."""
    tied_before = _is_tied(model)
    model.to_empty(device=device)
    if tied_before and not _is_tied(model):
        # Plain tensors: Module._apply gives each module its own new Parameter. (DTensor and FSDP
        # parameters are swapped in place with swap_tensors, which keeps the tie.)
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise RuntimeError("to_empty untied a sharded lm_head/wte pair")
        model.lm_head.weight = model.wte.weight
    fill_buffers_(model)  # to_empty leaves the rotary tables (Llama) uninitialised
    if init:
        init_sharded_(model, cfg, seed)


def _is_tied(model: nn.Module) -> bool:
    wte, head = getattr(model, "wte", None), getattr(model, "lm_head", None)
    return wte is not None and head is not None and head.weight is wte.weight
