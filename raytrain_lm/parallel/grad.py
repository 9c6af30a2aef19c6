"""Global gradient norm and clipping across every shard and stage.

torch.nn.utils.clip_grad_norm_ only sees one rank's tensors: with TP/FSDP the grads are DTensors
on different meshes (tp, (dp, tp), dp) mixed with Replicate ones, and with PP each rank holds
only its stages. Here each grad contributes the sum of squares of its local shard; those sums are
all-reduced over exactly the mesh dims on which that grad is sharded (a Replicate dim holds
copies and must not be summed), then over the pp group, with the pipeline's duplicate tied
embedding left out.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


@torch.no_grad()
def align_grads_(params) -> None:
    """Give every DTensor gradient its parameter's placements. DTensor autograd does not force
    them: under sequence parallelism a Replicate parameter (LayerNorm, row-parallel bias) that
    sees sequence-sharded activations gets a Partial gradient (the all-reduce is deferred until
    the grad is used); and a row-parallel (Shard(0)) embedding gets a Replicate, full-size
    (V, C) gradient from its lookup backward (every tp rank computes all rows). Redistributing
    performs the pending all-reduce, or keeps this rank's rows, so the norm, the tied-embedding
    sync and the optimizer see true, sharded grads.
    FSDP2 does the same for the parameters it manages before its reduce-scatter."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


@torch.no_grad()
def global_grad_norm(params, pp_group=None, exclude: set[int] = frozenset()) -> torch.Tensor:
    """The 2-norm of every gradient of the whole model, as a 0-dim fp32 tensor on the gradients'
    device: computed, reduced and returned there, with no host sync (torchtitan's order: local
    norms, the mesh reductions, then the pp all-reduce)."""
    plain: list[torch.Tensor] = []
    by_layout: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    meshes = {}
    device = None
    for p in params:
        if p.grad is None or id(p) in exclude:
            continue
        g = p.grad
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise RuntimeError("a Partial gradient: reduce it before clipping")
            # _StridedShard (FSDP2 over TP) is a shard too, but its is_shard() says False.
            dims = tuple(i for i, pl in enumerate(g.placements)
                         if pl.is_shard() or isinstance(pl, _StridedShard))
            # Key by the mesh's rank grid and dim names: the same on every rank of a group, so all
            # ranks issue the same collectives in the same order.
            key = (tuple(g.device_mesh.mesh.flatten().tolist()), g.device_mesh.mesh_dim_names, dims)
            meshes[key] = g.device_mesh
            by_layout[key].append(g.to_local())
        else:
            plain.append(g)
        device = device or g.device
    if device is None:  # no gradient on this rank; its pp peers may still hold some
        device = next((p.device for p in params), torch.device("cpu"))
    squares = [_sum_of_squares(plain, device)]
    for key in sorted(by_layout, key=repr):
        s = _sum_of_squares(by_layout[key], device)
        for d in key[2]:
            dist.all_reduce(s, group=meshes[key].get_group(d))
        squares.append(s)
    total = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of `grads` in fp32 (float64 for float64 gradients: a norm may not narrow)
    on `device` (0 for none), through the same fused per-tensor norms as
    torch.nn.utils.clip_grad_norm_."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    dtype = torch.promote_types(grads[0].dtype, torch.float32)
    norms = torch._foreach_norm(grads, 2, dtype=dtype) if len(grads) > 1 else \
        [torch.linalg.vector_norm(grads[0], 2, dtype=dtype)]
    return torch.stack(norms).square().sum()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None, exclude: set[int] = frozenset()) -> torch.Tensor:
    """Like torch.nn.utils.clip_grad_norm_ (same 1e-6 and clamp, no host sync), with the global
    norm. Every parameter with a grad is scaled, excluded duplicates included. Returns the norm
    (a 0-dim tensor on the gradients' device)."""
    params = list(params)
    align_grads_(params)
    norm = global_grad_norm(params, pp_group, exclude)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef)
    return norm
