"""The data-parallel dimension of a sharded layout (FSDP2, or DDP as FSDP2's replicate), and what a
rank can say about the shards it holds."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn as nn

from raytrain_lm.config.layout import Layout
from raytrain_lm.parallel import ep

# A Block returns (x, (k, v)) and k, v are views; FSDP2 warns about in-place ops on returned
# views. Nothing writes into them (they are only the KV cache), so the warning is noise.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def apply_dp(part: nn.Module, dp_mesh, layout: Layout, dtype: Optional[torch.dtype],
             compile: bool = False, edp_mesh=None) -> nn.Module:
    """Shard (zero1, zero2, fsdp) or replicate (ddp) a model part over the "dp" mesh dim, in
    place, before its parameters are materialised, one group per block, then the part's root
    (embeddings, final norm and the tied head: a shared parameter lives in one group), so each
    block's gradients are reduced as soon as its backward is done, while the backward of the
    blocks before it still runs. Both compose with tensor parallelism (the parameters are
    already DTensors on the tp dim) and with pipeline stages:
      fsdp:  FSDP2 `fully_shard` (ZeRO-3): parameters gathered in forward, freed, gathered again
             in backward; gradients reduce-scattered;
      zero2: the same with reshard_after_forward=False: each group's parameters are gathered
             once per micro-step and stay gathered until its backward;
      zero1: as zero2, and kept gathered through a step's micro-steps too (ddp.no_sync):
             ZeRO-1 as published, a reduce-scatter of the gradients and a gather of the updated
             parameters, the bytes of one all-reduce; AdamW's states and the fp32 parameters
             live sharded between steps;
      ddp:   the FSDP2-based `replicate` (unlike nn.parallel.DistributedDataParallel it takes
             DTensor parameters, and a pipeline stage knows to all-reduce its gradients after the
             last microbatch only): one all-reduce per group. Plain DDP without tp or pp goes
             through Ray (parallel/ddp.py).
    All average the gradients over dp, so dp-sharded batches give the whole batch's gradient.
    With expert parallelism (`edp_mesh`: the dp ranks that hold the same experts), each block's
    experts are sharded or replicated over edp first, as a group of their own (parallel/ep.py)."""
    if dp_mesh.size() == 1 and not layout.fsdp_on:  # (Layout.force: fully_shard on one rank)
        return part
    experts = ep.experts_of(part, blocks(part)) if edp_mesh is not None else []
    if not layout.by_fsdp:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for module in experts:
            replicate(module, mesh=edp_mesh)
        for block in blocks(part):
            replicate(block, mesh=dp_mesh)
        replicate(part, mesh=dp_mesh)
        return part
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Pipelined: kept gathered (each microbatch would re-gather otherwise); zero1/2: to backward.
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": not layout.pp_on and not layout.keeps_gathered}
    if dtype is not None:
        # Gather parameters and compute in `dtype`; reduce gradients in fp32 for accuracy. The
        # run's only mixed precision (no autocast around it: step.py).
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if compile:
        for block in blocks(part):
            block.compile()  # per block, as torchtitan does: FSDP's hooks stay outside graphs
    for module in experts:
        fully_shard(module, **{**kwargs, "mesh": edp_mesh})
    for block in blocks(part):
        fully_shard(block, **kwargs)
    fully_shard(part, **kwargs)
    return part


def blocks(part: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT (h: ModuleList) or of a pipeline stage (h: ModuleDict)."""
    return list(part.h.values()) if isinstance(part.h, nn.ModuleDict) else list(part.h)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard of a DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def to_float(t: torch.Tensor) -> float:
    """A scalar that may be a DTensor (FSDP's grad norm) as a Python float."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t)


def held_bytes(parts: list[nn.Module], optimizers: list) -> int:
    """Bytes this rank holds for parameters, gradients and optimizer states (local shards)."""
    total = 0
    for p in {id(p): p for part in parts for p in part.parameters()}.values():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    total += local(v).numel() * v.element_size()
    return total


def param_fraction(parts: list[nn.Module], total: int) -> float:
    """Share of the model's `total` parameters stored on this rank: 1.0 with DDP, ~1/world with
    FSDP, 1/tp with tensor parallelism, one stage's share with pipelining."""
    return sum(local(p).numel() for p in {id(p): p for part in parts
                                          for p in part.parameters()}.values()) / total
