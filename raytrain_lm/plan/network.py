"""Bandwidth a mesh dimension's collectives see, per GPU per direction.

A group inside one node runs over the node's GPU links (NVLink/NVSwitch, or PCIe). A group that
spans nodes runs, for each node, over all the node's NICs at once: NCCL opens several channels, so
different rings leave the node through different NICs (one rail per GPU), and only the hops at a
node boundary cross the network (stas00/ml-engineering network/README.md, 'Inter-node speed depends
on intra-node speed': the single-NIC arithmetic is 3.9x too slow against a measured 4-node
all-reduce; a flat ring over the node's NICs is within 6% of it). With k of a group's members in
each node, node / k groups of that dimension run at once and share the node's NICs, so each group
gets k NICs' worth: bandwidth per GPU = min(GPU links, k x the node's NIC bandwidth / GPUs per
node). Pipeline sends follow the same arithmetic (the GPUs at a node's last stage share its NICs).
Every link runs at LINK_EFFICIENCY of its line rate (the same source: NCCL's bus bandwidth at large
messages, 78% of NVLink 3 on A100, 82% of NVLink 4 on H200, 73-74% of EFA on B200).

Ranks as parallel/mesh.py places them: tp innermost (stride 1), then cp (stride tp), then dp
(stride cp x tp; an expert-parallel group is ep consecutive dp ranks of one cp index: stride
cp x tp), pp outermost (stride
dp x cp x tp). With context parallelism the parameters' gradients are reduced over dp x cp (the
"dp" dimension here: stride tp, dp x cp ranks), the keys and values gathered over cp.
"""

from __future__ import annotations

from raytrain_lm.config.layout import Layout
from raytrain_lm.plan.hardware import Cluster

LINK_EFFICIENCY = 0.8


def stride(lay: Layout, dim: str) -> int:
    return {"tp": 1, "cp": lay.tp, "dp": lay.tp, "ep": lay.cp * lay.tp, "pp": lay.dp_cp * lay.tp}[dim]


def size(lay: Layout, dim: str) -> int:
    return {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp_cp, "ep": lay.ep, "pp": lay.pp}[dim]


def members_per_node(cl: Cluster, lay: Layout, dim: str) -> int:
    """A group's ranks in one node (all of them when the group stays inside a node)."""
    step = stride(lay, dim)
    return max(1, min(size(lay, dim), cl.node // step)) if step < cl.node else 1


def inside(cl: Cluster, lay: Layout, dim: str) -> bool:
    """Whether every group of the dimension stays inside one node."""
    span = stride(lay, dim) * size(lay, dim)
    return cl.inside(span)


def bandwidth(cl: Cluster, lay: Layout, dim: str) -> float:
    """Bytes/s per GPU per direction for the dimension's collectives and sends."""
    intra = cl.intra_gbps * 1e9 / 8
    if size(lay, dim) == 1 or inside(cl, lay, dim):
        return intra * LINK_EFFICIENCY
    nics = members_per_node(cl, lay, dim) * cl.inter_gbps * 1e9 / 8
    return min(intra, nics) * LINK_EFFICIENCY
