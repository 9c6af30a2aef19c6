"""Expert parallelism (--ep, as torchtitan's ExpertParallel): each block's routed experts split
over the "ep" mesh dim, tokens sent to the ranks holding their experts and back by
`all_to_all_single` with uneven splits; and the mixture of experts' training metrics.

An expert-parallel group is ep data-parallel ranks (parallel/mesh.py): each reads its own
sequences, routes them, and sends each (token, expert) pair to the rank holding expert e (rank
e // (E/ep)); each rank computes its E/ep experts on every pair the group sent them and sends the
outputs back. The experts' weights are distributed tensors sharded by expert (Shard(0) on ep), so
checkpoints (DCP) keep the single-process names and shapes and load at any other layout; the data
parallelism of the rest of dp (edp: FSDP2 or replicate, parallel/fsdp.py) then shards or
replicates them as it does every other parameter.

Gradients: a rank's expert receives the gradient of every loss of its group (the all-to-all's
backward brings them), each the mean over that rank's tokens; FSDP2/replicate over edp then
average over edp only, which would count them ep times too often. So the experts' part of the
backward is scaled by 1/ep (their weights' gradients; their inputs' gradients are scaled back by
ep: `_GradScale`, exact for a power of two), and every parameter's gradient is the gradient of the
mean loss over the global batch, as one worker's. (FSDP2's own divide factor would do it for
FSDP, but divides twice where edp is one rank, in torch 2.13.)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import Shard, distribute_tensor

from raytrain_lm.models import family


def experts_of(part: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The routed experts module of each block (none for a dense family)."""
    name = family(part.cfg).experts
    return [block.get_submodule(name) for block in blocks] if name else []


def moe_layers(part: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, MoE layer) of every mixture-of-experts layer this part holds."""
    out = []
    for name, module in part.named_modules():
        if hasattr(module, "take_aux_loss") and hasattr(module, "dispatch"):
            layer = next(int(p) for p in name.split(".") if p.isdigit())
            out.append((layer, module))
    return out


def apply_ep(part: nn.Module, ep_mesh, blocks: list[nn.Module]) -> None:
    """Split each block's experts over `ep_mesh` (on the meta device, before data parallelism)
    and give its MoE layer the all-to-all dispatch."""
    group = ep_mesh.get_group()
    for experts in experts_of(part, blocks):
        for name, p in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(p, ep_mesh, [Shard(0)]),
                                                          requires_grad=p.requires_grad))
    for _, layer in moe_layers(part):
        layer.dispatch = AllToAllDispatch(group)


class AllToAllDispatch:
    """The MoE layer's dispatch across an expert-parallel group (models/moe/moe.py calls it with
    the (token, expert) pairs' inputs grouped by expert and the count per expert)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.size = group, dist.get_world_size(group)

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        P, e = self.size, counts.numel() // self.size
        with torch.no_grad():  # what each rank sends each of my experts
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
        by_rank = received.view(P, e)  # (source rank, my expert)
        # The all-to-all takes its split sizes as host ints: this one read of them (a sync per
        # layer, its backward reuses them) is the floor; it brings my experts' row counts too
        # (the loop over experts wants them), everything else stays on the device.
        mine = by_rank.sum(0)
        sizes = torch.cat([counts.view(P, e).sum(1), by_rank.sum(1), mine]).tolist()
        send, recv, host_mine = sizes[:P], sizes[P:2 * P], sizes[2 * P:]
        x = all_to_all_single_autograd(routed, recv, send, self.group)  # rank-major
        order = expert_major(by_rank, sum(recv))
        y = _GradScale.apply(experts(_GradScale.apply(x[order], P), mine, host_mine), 1.0 / P)
        y = torch.zeros_like(y).index_copy(0, order, y)  # back to rank-major
        return all_to_all_single_autograd(y, send, recv, self.group)


def expert_major(by_rank: torch.Tensor, total: int) -> torch.Tensor:
    """The rows of a rank-major block (rank r's rows for expert j at position
    sum(by_rank[:r]) + sum(by_rank[r, :j])) in expert-major order: expert 0's rows from rank 0,
    1, ..., then expert 1's, as the experts' grouped rows want them. `total`: by_rank's sum, a
    host int (repeat_interleave would read it from the device otherwise)."""
    P, e = by_rank.shape
    flat = by_rank.reshape(-1)
    starts = (flat.cumsum(0) - flat).view(P, e).t().reshape(-1)  # each (expert, rank) segment's start
    lengths = by_rank.t().reshape(-1)
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=flat.device), lengths,
                                      output_size=total)
    offsets = lengths.cumsum(0) - lengths
    return starts[segment] + torch.arange(total, device=flat.device) - offsets[segment]


class _GradScale(torch.autograd.Function):
    """x unchanged; its gradient multiplied by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


@torch.no_grad()
def moe_stats(parts: list[nn.Module], n_layer: int, n_experts: int, counts_here: bool) -> torch.Tensor:
    """This rank's mixture-of-experts statistics since the last call, to be summed over every
    rank (by the caller's one gather: worker/metrics.Meter) and read by `moe_summary`: a flat
    float64 (n_layer x (n_experts + 3)) table, row i layer i's tokens per expert, then its sums
    of the balance loss and the z-loss, and its forwards; zeros for the layers this rank does not
    hold (a pipeline stage). Resets the layers' statistics; no collective. `counts_here`: this
    rank's statistics count (not a tp peer's copy)."""
    device = next((p.device for part in parts for p in part.parameters()), torch.device("cpu"))
    table = torch.zeros(n_layer, n_experts + 3, dtype=torch.float64, device=device)
    for part in parts:
        for i, layer in moe_layers(part):
            if layer.stats is not None:
                if counts_here:
                    table[i] = layer.stats.to(table)
                layer.stats.zero_()
    return table.reshape(-1)


def moe_summary(summed: torch.Tensor, n_layer: int) -> Optional[dict]:
    """The mixture of experts' training metrics from `moe_stats`' tables summed over every rank:
    `aux_loss` and `z_loss` (the mean over layers and forwards of the balance loss, 1.0 when
    balanced, and of the router z-loss) and `expert_load`, each MoE layer's max / mean tokens per
    expert (1.0: balanced); None where no layer ran a training forward."""
    table = summed.view(n_layer, -1)
    used = table[:, -1] > 0
    if not used.any():
        return None
    table = table[used]
    load = table[:, :-3]
    forwards = table[:, -1]
    return {"aux_loss": (table[:, -3] / forwards).mean().item(),
            "z_loss": (table[:, -2] / forwards).mean().item(),
            "expert_load": (load.max(1).values / load.mean(1)).tolist()}
