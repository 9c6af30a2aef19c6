"""The cluster a layout is planned for: GPUs, their memory, links and peak, and what the training
framework does. `kind_cluster` builds one from a GPU kind (plan/kinds.py, the one table: `plan
--gpu KIND`, `train --layout auto`, the memory check), validation rows from their kind and
framework (frameworks.py); a bare Cluster's figures are the default kind's (h100-sxm) and this
project's framework."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_lm.plan.calibration import clock_factor
from raytrain_lm.plan.kinds import DEFAULT_KIND, kind

GB = 1e9  # bytes sent (link speeds are decimal)
GIB = 2 ** 30  # bytes of memory: an "80 GB" card holds 80 GiB (torch reports 80 x 2^30 for an A100 80GB)
# Reserved outside the planned allocations: the CUDA context, cuBLAS's workspace and NCCL's
# buffers (assumed, not measured here; the fitted allocator factor absorbs its error on the rows
# that publish memory: plan/calibration.json)
OVERHEAD_GIB = 1.0
USABLE_FRACTION = 0.9  # of a CPU worker's memory (no CUDA allocator)
_DEFAULT = kind(DEFAULT_KIND)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = _DEFAULT.gpus_per_node
    memory_gb: float = _DEFAULT.memory_gb
    intra_gbps: float = _DEFAULT.intra_gbs * 8  # per GPU per direction, gigabits per second
    inter_gbps: float = _DEFAULT.inter_gbps
    tflops: float = _DEFAULT.half_tflops  # peak per GPU
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
    # The GPU kind's rates beyond the peak (plan/gpu_kinds.json):
    kind: str = DEFAULT_KIND
    hbm_tbps: float = _DEFAULT.hbm_tbps  # HBM bandwidth, TB/s
    matmul_fraction: float = _DEFAULT.matmul_fraction  # the best bf16 matmul over the peak (MAMF / peak)
    clock_factor: float = clock_factor(DEFAULT_KIND)  # a power-capped part's sustained rate over its chip's MAMF
    attention_fraction: float = _DEFAULT.attention_fraction  # flash attention's fraction of the peak
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
    # The software generation's kernel efficiency (calibration.json; frameworks.Framework.efficiency)
    # and whether tp communication is pipelined with the matmuls (Transformer Engine)
    eta_key: str = "eta"
    tp_overlap_matmul: bool = False

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
        builds its strategy: FSDP2's strategies shard them (Layout.sharded), but one that gathers
        once per step (ZeRO-1: Layout.gathers_once) built on whole replicas (`zero1` not "fsdp2")
        shards only AdamW's states."""
        return lay.sharded and not (lay.gathers_once and self.zero1 != "fsdp2")

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


def kind_cluster(key: str, gpus: int, gpus_per_node: Optional[int] = None,
                 memory_gb: Optional[float] = None, intra_gbps: Optional[float] = None,
                 inter_gbps: Optional[float] = None, tflops: Optional[float] = None,
                 hbm_tbps: Optional[float] = None, **rest) -> Cluster:
    """The cluster of `gpus` GPUs of kind `key`; a figure given overrides the kind's."""
    k = kind(key)

    def given(value, default):
        return default if value is None else value

    return Cluster(gpus=gpus, gpus_per_node=given(gpus_per_node, k.gpus_per_node),
                   memory_gb=given(memory_gb, k.memory_gb), intra_gbps=given(intra_gbps, k.intra_gbs * 8),
                   inter_gbps=given(inter_gbps, k.inter_gbps), tflops=given(tflops, k.half_tflops),
                   kind=key, hbm_tbps=given(hbm_tbps, k.hbm_tbps), matmul_fraction=k.matmul_fraction,
                   clock_factor=clock_factor(key), attention_fraction=k.attention_fraction, **rest)
