"""The device mesh: one named dimension per kind of parallelism, built in one place from the
Layout's mesh_shape (config/layout.py, where a rank's coordinates are computed too).

Rank -> coordinates (row-major, tp innermost):

    rank = (pp_i * dp + dp_i) * tp + tp_i
    pp_i = rank // (dp * tp),  dp_i = (rank // tp) % dp,  tp_i = rank % tp

e.g. 8 workers, --pp 2 --tp 2 (so dp = 2):  rank: 0 1 2 3 4 5 6 7
                                             pp:  0 0 0 0 1 1 1 1
                                             dp:  0 0 1 1 0 0 1 1
                                             tp:  0 1 0 1 0 1 0 1

Ray Train gives the workers of one node consecutive ranks (it sorts them by node), so:
- tp innermost: a tp group is `tp` consecutive ranks, inside one node as long as tp divides the
  GPUs per node. Tensor parallelism all-reduces activations after every layer: it needs NVLink.
- pp outermost (as Megatron-LM and torchtitan): pipeline stages exchange one microbatch's
  activations point to point, the smallest traffic, so they are the ones to put across nodes.
- dp in between: when tp is smaller than a node, FSDP's gathers and DDP's all-reduce stay inside
  it for the first dp ranks and cross nodes only beyond.
Dims are always addressed by name (mesh["dp"], ...); dims of size 1 are kept, so code never
special-cases them.

Context parallelism (--cp) adds a "cp" dim between dp and tp: a cp group is cp x tp
consecutive ranks (a node's, as long as it fits), and "dp_cp" flattens dp and cp: the ranks that
hold the same parameters and average their gradients. With expert parallelism too the mesh is
pp, edp, ep, cp, tp: a rank's dp and cp indices are those without ep, an expert-parallel group
is ep ranks of one cp index (stride cp x tp), and "edp_cp" flattens edp and cp: the ranks that
hold the same experts. e.g. 4 workers, --ep 2 --cp 2: ep 0 0 1 1, cp 0 1 0 1.

Expert parallelism (--ep) splits dp into edp x ep, ep innermost, and flattens them back into
"dp" (what the dense parameters and the data see): an expert-parallel group is ep consecutive
dp ranks, inside a node as long as tp x ep divides the GPUs per node, and a rank's dp index is
the same as without it. e.g. 4 workers, --ep 2: edp 0 0 1 1, ep 0 1 0 1, dp 0 1 2 3.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from raytrain_lm.config.layout import Layout


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def build_mesh(device: torch.device, layout: Layout):
    """The layout's mesh (pp, dp, tp; with ep: pp, edp, ep, tp and "dp" flattened) over every
    worker."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = layout.mesh_shape
    if dist.get_world_size() != layout.gpus:
        raise ValueError(f"{dist.get_world_size()} workers are not the layout's {layout.gpus}")
    mesh = init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    for dim in layout.mesh_dims:
        match_world_timeout(dim_mesh(mesh, dim).get_group())
    return mesh


def dim_mesh(mesh, dim: str):
    """The mesh of one named dim: the root's, or "dp" flattened from edp x ep under expert
    parallelism (torch deprecates slicing a flattened dim from the root; flattening again
    returns the same mesh and groups)."""
    if dim == "dp" and "edp" in mesh.mesh_dim_names:
        return mesh["edp", "ep"]._flatten("dp")
    if dim == "dp_cp":  # the parameters' group under context parallelism
        dp = ("edp", "ep") if "edp" in mesh.mesh_dim_names else ("dp",)
        return mesh[(*dp, "cp")]._flatten("dp_cp")
    if dim == "edp_cp":  # the experts' group under context and expert parallelism
        return mesh["edp", "cp"]._flatten("edp_cp")
    return mesh[dim]


def world_timeout():
    """The timeout of the world process group (Ray Train sets it: TorchConfig.timeout_s), a
    timedelta; None where the backend does not say."""
    pg = dist.distributed_c10d._get_default_group()
    for device in pg._device_types:
        options = getattr(pg._get_backend(device), "options", None)
        if options is not None and hasattr(options, "_timeout"):
            return options._timeout
    return None


def match_world_timeout(group) -> None:
    """Give a sub-group the world group's timeout (as torchtitan's set_pg_timeouts). Sub-groups
    otherwise get the backend's default (NCCL: 10 minutes) while Ray gives the world 30: a rank
    waiting in a mesh dim's collective for a peer that downloads a shard or uploads a checkpoint
    would time out on the sub-group first."""
    timeout = world_timeout()
    if timeout is not None and group is not None:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


# torch 2.13's names of the flat-tensor collectives; the old ones warn there on every call
# (torch 2.11, the GPU host's, has only the old ones)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every worker's 1-D `t`, one row each: (world, len(t)); one row in a single process."""
    if not is_distributed():
        return t.unsqueeze(0)
    out = torch.empty(dist.get_world_size() * t.numel(), dtype=t.dtype, device=t.device)
    ALL_GATHER(out, t)  # (gloo takes a flat output only)
    return out.view(-1, t.numel())


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In place over every worker (or `group`); nothing to do in a single process. Returns `t`."""
    if is_distributed():
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return t
