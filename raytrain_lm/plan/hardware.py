"""The cluster a layout is planned for: GPUs, their memory, links and peak, and what the training
framework overlaps. Its defaults are H100 SXM nodes of 8 GPUs (docs/planner.md: where each comes
from)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_lm.plan.gpus import GPUS

GB = 1e9  # bytes sent (link speeds are decimal)
GIB = 2 ** 30  # bytes of memory: an "80 GB" card holds 80 GiB (torch reports 80 x 2^30 for an A100 80GB)
USABLE_FRACTION = 0.9
# NVLink 4: 900 GB/s per GPU both directions together = 450 GB/s = 3600 Gb/s per direction.
H100_NVLINK_GBPS = 3600.0
# One 400 Gb/s InfiniBand (or RoCE) NIC per GPU, as in DGX H100 and Meta's Grand Teton hosts.
IB_400_GBPS = 400.0
H100_TFLOPS = GPUS["H100 80GB"].bf16  # H100 SXM dense bf16
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = GPUS_PER_NODE
    memory_gb: float = 80.0
    intra_gbps: float = H100_NVLINK_GBPS  # per GPU per direction, gigabits per second
    inter_gbps: float = IB_400_GBPS
    tflops: float = H100_TFLOPS  # peak per GPU
    efficiency: Optional[float] = None  # of the peak, reached by the matmuls; None: efficiency.py
    gpu: bool = True  # False: CPU workers (fp32 activations)
    precision: str = "auto"  # the run's --precision: auto is bf16 on GPU, fp32 on CPU
    peak_fraction: Optional[float] = None  # efficiency.py's ceiling; None: its default
    # Whether the training framework overlaps the gradient reduction with backward (this
    # project's DDP and FSDP2 do; Megatron-LM's DDP of 2021 reduced after the backward pass)
    overlap_reduce: bool = True
    # Bytes a gradient value takes in the data-parallel reduction: fp32 here (FSDP2's
    # reduce_dtype, DDP's fp32 gradients); Megatron-LM reduces fp16 gradients in fp16 unless
    # --accumulate-allreduce-grads-in-fp32
    reduce_bytes: int = 4
    # Whether full recomputation stops once backward has what it needs (torch.utils.checkpoint's
    # non-reentrant default, this project's and torchtitan's: a block's last matmul and its
    # all-reduce are not run again); Megatron-LM's and DeepSpeed's checkpointing reruns the
    # whole block
    recompute_early_stop: bool = True
    # Whether pipeline sends overlap compute (torch.distributed.pipelining posts them
    # asynchronously); Megatron-LM's p2p of 2021 (and Megatron-DeepSpeed's) waits for each
    # batched send/receive and synchronizes the device before computing on
    overlap_pp: bool = True

    @property
    def budget(self) -> float:
        """Bytes a GPU may plan for: --gpu-memory-gb is GiB, as cards are sold."""
        return self.memory_gb * GIB * USABLE_FRACTION

    @property
    def act_bytes(self) -> int:
        """Activations, checkpointed block inputs, gathered FSDP parameters, tp collectives and
        pipeline sends: 2 bytes in bf16/fp16, 4 in fp32 (auto: bf16 on GPU, fp32 on CPU)."""
        if self.precision == "auto":
            return 2 if self.gpu else 4
        return 4 if self.precision == "fp32" else 2

    @property
    def node(self) -> int:
        """GPUs that share a node's fast links (all of them when they do not fill one node)."""
        return min(self.gpus_per_node, self.gpus)

    def inside(self, block: int) -> bool:
        """Whether a group whose ranks lie in aligned blocks of `block` consecutive ranks stays
        inside one node."""
        return block <= self.node and self.node % block == 0

    def bandwidth(self, block: int) -> float:
        """Bytes/s per GPU per direction for such a group."""
        return (self.intra_gbps if self.inside(block) else self.inter_gbps) * 1e9 / 8
