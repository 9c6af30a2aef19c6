"""The cluster a layout is planned for: GPUs, their memory, links and peak, and what the training
framework does. Its defaults are H100 SXM nodes of 8 GPUs and this project's framework; `plan
--gpu KIND` builds one from a kind (kinds.py), validation rows from their kind and framework
(frameworks.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_lm.plan.gpus import GPUS

GB = 1e9  # bytes sent (link speeds are decimal)
GIB = 2 ** 30  # bytes of memory: an "80 GB" card holds 80 GiB (torch reports 80 x 2^30 for an A100 80GB)
# Reserved outside the planned allocations: the CUDA context, cuBLAS's workspace and NCCL's
# buffers (assumed, not measured here; the fitted allocator factor absorbs its error on the rows
# that publish memory: plan/calibration.json)
OVERHEAD_GIB = 1.0
USABLE_FRACTION = 0.9  # of a CPU worker's memory (no CUDA allocator)
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
    efficiency: Optional[float] = None  # --compute-efficiency: a constant fraction of the peak; None: plan/kernels.py
    gpu: bool = True  # False: CPU workers (fp32 activations)
    precision: str = "auto"  # the run's --precision: auto is bf16 on GPU, fp32 on CPU
    peak_fraction: Optional[float] = None  # --peak-fraction: large matmuls' fraction of the peak; None: the kind's
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
    # The GPU kind's rates beyond the peak (plan/gpu_kinds.json; the defaults are the H100 SXM's):
    kind: str = "h100-sxm"
    hbm_tbps: float = 3.35  # HBM bandwidth, TB/s
    matmul_fraction: float = 0.803  # the best bf16 matmul over the peak (MAMF / peak)
    clock_factor: float = 1.0  # a power-capped part's sustained rate over its chip's MAMF
    attention_fraction: float = 0.35  # flash attention's fraction of the peak
    # How the framework runs (plan/frameworks.py; the defaults are this project's):
    kernels: str = "eager"  # memory-bound kernels: "eager" (fp32 RMSNorm as several kernels) or "fused"
    attention: str = "flash"  # "flash" (fused, causal blocks skipped) or "unfused" (scores in memory)
    # FSDP with gradient accumulation: "unsharded" keeps every fp32 gradient unsharded until the
    # last micro-step (FSDP2's no_sync, this project's); "reduce_scatter" reduce-scatters each
    # micro-step and keeps only the shard (FSDP1 under Composer, DeepSpeed ZeRO-2/3)
    accumulate: str = "unsharded"
    loss: str = "fp32"  # the loss: "fp32" (logits upcast; torch's cross-entropy) or "fused" (bf16, in place)
    pp_scatter_gather: bool = False  # pipeline sends split over tp (Megatron-LM's scatter/gather)
    tp_overlap_backward: bool = False  # backward tp all-reduces hidden behind weight-gradient matmuls
    # ZeRO-1 as the framework builds it: "fsdp2" is this project's (config/layout.py: FSDP2 shards
    # the parameters and gradients at rest, reduce-scatters the gradients and gathers the
    # parameters once a step, both overlapped); "all_reduce" or "reduce_scatter": every rank keeps
    # the whole parameters and gradients, reduces the gradients so after backward and all-gathers
    # the updated parameters after the optimizer step (DeepSpeed's ZeRO stage 1, Megatron-LM's
    # distributed optimizer: frameworks.py)
    zero1: str = "fsdp2"

    @property
    def matmul_ceiling(self) -> float:
        """The fraction of the peak large matmuls reach: --peak-fraction, else the kind's
        MAMF / peak x its clock factor."""
        return self.peak_fraction if self.peak_fraction is not None else \
            self.matmul_fraction * self.clock_factor

    @property
    def budget(self) -> float:
        """Bytes a GPU may plan for: the card's memory (--gpu-memory-gb is GiB, as cards are
        sold) less the CUDA context and NCCL's buffers (OVERHEAD_GIB); what the caching
        allocator reserves for the planned allocations must fit in it. CPU workers: 90% of
        theirs."""
        if not self.gpu:
            return self.memory_gb * GIB * USABLE_FRACTION
        return (self.memory_gb - OVERHEAD_GIB) * GIB

    @property
    def act_bytes(self) -> int:
        """Activations, checkpointed block inputs, gathered FSDP parameters, tp collectives and
        pipeline sends: 2 bytes in bf16/fp16, 4 in fp32 (auto: bf16 on GPU, fp32 on CPU)."""
        if self.precision == "auto":
            return 2 if self.gpu else 4
        return 4 if self.precision == "fp32" else 2

    def shards_params(self, lay) -> bool:
        """Whether `lay`'s parameters and gradients lie sharded over dp at rest as this framework
        builds its strategy: FSDP2's strategies shard them (Layout.sharded), but a ZeRO-1 built on
        whole replicas (`zero1` not "fsdp2") shards only AdamW's states."""
        return lay.sharded and not (lay.strategy == "zero1" and self.zero1 != "fsdp2")

    def param_shards(self, lay) -> int:
        """Ranks each parameter and gradient of `lay` is spread over at rest (shards_params)."""
        return lay.param_shards if self.shards_params(lay) else 1

    @property
    def node(self) -> int:
        """GPUs that share a node's fast links (all of them when they do not fill one node)."""
        return min(self.gpus_per_node, self.gpus)

    def inside(self, block: int) -> bool:
        """Whether a group whose ranks lie in aligned blocks of `block` consecutive ranks stays
        inside one node."""
        return block <= self.node and self.node % block == 0
