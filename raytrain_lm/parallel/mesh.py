"""The process group and device mesh the parallel layouts share: built in one place."""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_mesh(device: torch.device):
    """A 1-D mesh over every worker (the data-parallel dimension)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place over every worker (nothing to do in a single process); returns `t`."""
    if is_distributed():
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t
