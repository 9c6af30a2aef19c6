"""FSDP2: parameters, gradients and optimizer states sharded across the data-parallel workers, and
what a rank can say about its shards."""

from __future__ import annotations

import torch

from raytrain_lm.config import TrainConfig
from raytrain_lm.parallel.mesh import world_mesh


def shard(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """FSDP2 in place: each block, then the root (embeddings, final norm, tied head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(device)
    if cfg.compile:
        for block in model.h:
            block.compile()  # per block, as torchtitan does: FSDP's hooks stay outside graphs
    kwargs = {"mesh": world_mesh(device)}
    if device.type == "cuda" and cfg.precision in ("auto", "bf16"):
        # Gather parameters and compute in bf16; reduce gradients in fp32 for accuracy.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for block in model.h:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard of a DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def to_float(t: torch.Tensor) -> float:
    """A scalar that may be a DTensor (FSDP's grad norm) as a Python float."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t)


def model_state_bytes(model: torch.nn.Module, optimizer) -> int:
    """Bytes this rank holds for parameters, gradients and optimizer states (local shards)."""
    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += local(v).numel() * v.element_size()
    return total


def local_param_fraction(model: torch.nn.Module) -> float:
    """Share of the model's parameters stored on this rank: 1.0 with DDP, ~1/world with FSDP."""
    return sum(local(p).numel() for p in model.parameters()) / sum(p.numel() for p in model.parameters())
