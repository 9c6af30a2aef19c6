"""What a training framework does that changes a layout's time and memory: the inputs the planner
takes per framework (the same for every run of it), each from the framework's documented behaviour
or code. `plan` plans for this project's own ("raytrain-lm"); docs/planner.md's validation rows
name theirs (published_runs.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from raytrain_lm.plan.hardware import Cluster


@dataclass(frozen=True)
class Framework:
    title: str
    # Gradient reduction overlaps backward (DDP's buckets, FSDP's per-block reduce-scatter);
    # Megatron-LM of 2021-22 all-reduced after the backward pass
    overlap_reduce: bool = True
    # Bytes per gradient value in the data-parallel reduction
    reduce_bytes: int = 4
    # Full recomputation stops once backward has what it needs (torch.utils.checkpoint's
    # non-reentrant mode); Megatron-LM's and DeepSpeed's checkpointing reruns the whole block
    recompute_early_stop: bool = True
    # Pipeline sends overlap compute (torch.distributed.pipelining, Llama 3's asynchronous p2p);
    # Megatron-LM's p2p of 2021 waited for each send and synchronized the device
    overlap_pp: bool = True
    kernels: str = "eager"  # memory-bound kernels: eager or fused (kernels.py counts both)
    attention: str = "flash"  # flash or unfused (scores written to memory)
    accumulate: str = "unsharded"  # FSDP and gradient accumulation: unsharded or reduce_scatter
    loss: str = "fp32"  # the loss: fp32 (logits upcast, torch's cross-entropy) or fused (bf16, in place)
    # Pipeline sends split over the tp ranks and all-gathered over NVLink on arrival (Megatron-LM's
    # scatter/gather optimization, Narayanan et al. 2021 Section 4.1)
    pp_scatter_gather: bool = False
    # Backward tp all-reduces overlap the weight-gradient matmuls (Korthikanti et al. 2022, Section 6.2)
    tp_overlap_backward: bool = False
    # ZeRO-1 (Cluster.zero1): "fsdp2", this project's, on FSDP2 (torchtitan, Composer and Llama 3's
    # stack have none of their own: their runs here use FSDP); "all_reduce" / "reduce_scatter":
    # whole parameters and gradients on every rank, the gradients reduced that way after backward,
    # the updated parameters all-gathered in the compute dtype after the optimizer step
    zero1: str = "fsdp2"
    # Software generation: the calibration constant (calibration.json) of the kernel efficiency
    # its compute time divides by, fitted on that generation's in-sample rows only: "eta" (the
    # stacks of 2021-23 and this project's eager trainer) or "eta:2024" (2024 stacks on H100:
    # fused/flash attention kernels, overlapped reductions, pipeline sends and tp communication)
    efficiency: str = "eta"
    # Tensor-parallel all-gathers / reduce-scatters pipelined with the matmuls that produce or
    # consume them, forward and backward (Transformer Engine's userbuffers, Megatron-Core's
    # tp_comm_overlap): only what the step's compute does not cover is exposed
    tp_overlap_matmul: bool = False
    not_modelled: Optional[str] = None  # why the planner does not model this framework's runs


FRAMEWORKS = {
    "raytrain-lm": Framework(
        "this project: DDP/FSDP2 with no_sync accumulation, ZeRO-1 on FSDP2 (a reduce-scatter and "
        "one all-gather a step, overlapped), torch's pipelining and checkpoint, eager kernels, SDPA "
        "flash attention"),
    "torchtitan": Framework("torchtitan without torch.compile: FSDP2, eager RMSNorm in fp32, SDPA flash "
                            "attention, torch.utils.checkpoint"),
    "torchtitan-compile": Framework("torchtitan with torch.compile: as torchtitan, the memory-bound "
                                    "kernels fused", kernels="fused"),
    "megatron-2021": Framework(
        "Megatron-LM of 2021 (Narayanan et al.): fp16 gradients all-reduced in fp16 after backward, "
        "fused LayerNorm/GeLU/dropout kernels, unfused attention (scaled-masked-softmax over the "
        "scores), full recomputation of whole blocks, blocking p2p with scatter/gather; ZeRO-1 as "
        "Megatron-LM's distributed optimizer (a reduce-scatter, then an all-gather of the updated "
        "parameters; no row here uses it)", overlap_reduce=False,
        reduce_bytes=2, recompute_early_stop=False, overlap_pp=False, kernels="fused",
        attention="unfused", pp_scatter_gather=True, zero1="reduce_scatter"),
    "megatron-2022": Framework(
        "Megatron-LM of 2022 (Korthikanti et al.): as of 2021, with sequence parallelism and "
        "selective recomputation of the attention core; 'we do not use any overlapping of gradient "
        "all-reduces'; backward tp all-reduces overlap the weight gradients' matmuls; ZeRO-1 as "
        "its distributed optimizer (no row here uses it)",
        overlap_reduce=False, reduce_bytes=2, recompute_early_stop=False, overlap_pp=False,
        kernels="fused", attention="unfused", pp_scatter_gather=True, tp_overlap_backward=True,
        zero1="reduce_scatter"),
    "megatron-deepspeed": Framework(
        "Megatron-DeepSpeed (MT-NLG, BLOOM): Megatron's kernels and unfused attention, DeepSpeed's "
        "pipeline engine (blocking sends), full recomputation of whole blocks; DeepSpeed's ZeRO-1 "
        "(bf16: BF16_Optimizer) keeps the whole parameters and gradients on every rank, all-reduces "
        "the fp32 gradients after the last micro-batch (PipelineEngine._bf16_reduce_grads) and "
        "all-gathers the updated bf16 parameters after the optimizer step (update_lp_params)",
        recompute_early_stop=False, overlap_pp=False, kernels="fused", attention="unfused",
        zero1="all_reduce"),
    "composer-fsdp": Framework(
        "MosaicML Composer with PyTorch FSDP (llm-foundry's MPT): FSDP1 reduce-scatters every "
        "micro-step (Composer applies no_sync to DDP only: composer/trainer/trainer.py), single-"
        "kernel LayerNorm and GeLU, Triton flash attention, flash-attn's fused cross-entropy (MPT's "
        "default loss_fn)", kernels="fused", accumulate="reduce_scatter", loss="fused"),
    "meta-llama3": Framework(
        "Meta's Llama 3 training stack (Llama 3 paper, Section 3.3.2): FSDP without resharding after "
        "forward, TP, interleaved PP with asynchronous p2p; its kernels are not described (fused "
        "assumed); a 2024 stack on H100 (its kernel efficiency: eta:2024)", kernels="fused",
        efficiency="eta:2024"),
    "megatron-core-2024": Framework(
        "Megatron-Core with Transformer Engine as of 2024 (NeMo 24.x, Nemotron-4): fused "
        "LayerNorm/activation kernels and fused flash attention (cuDNN/TE), the distributed "
        "optimizer's gradient reduce-scatter overlapped with backward and its parameter "
        "all-gather with the next forward (overlap_grad_reduce, overlap_param_gather: planned as "
        "ZeRO-1 on FSDP2, the same bytes at rest), interleaved pipeline sends overlapped "
        "(overlap_p2p_comm) and split over the tp ranks under sequence parallelism, tp "
        "communication pipelined with the matmuls (tp_comm_overlap); Megatron's full "
        "recomputation reruns whole blocks", recompute_early_stop=False, kernels="fused",
        pp_scatter_gather=True, tp_overlap_backward=True, tp_overlap_matmul=True,
        efficiency="eta:2024"),
    "deepspeed-zero3-2021": Framework(
        "DeepSpeed ZeRO-3 as Narayanan et al. ran it in 2021", recompute_early_stop=False,
        kernels="fused", attention="unfused", accumulate="reduce_scatter",
        not_modelled="its parameter fetch and partitioning are not FSDP's"),
    "fms-fsdp": Framework("IBM's fms-fsdp: PyTorch FSDP1 with torch.compile", kernels="fused",
                          not_modelled="HSDP and a fraction of blocks checkpointed"),
}
DEFAULT = "raytrain-lm"


def apply(cl: Cluster, name: str) -> Cluster:
    """`cl` as `name`'s framework runs on it."""
    f = FRAMEWORKS[name]
    return dataclasses.replace(cl, overlap_reduce=f.overlap_reduce, reduce_bytes=f.reduce_bytes,
                               recompute_early_stop=f.recompute_early_stop, overlap_pp=f.overlap_pp,
                               kernels=f.kernels, attention=f.attention, accumulate=f.accumulate,
                               loss=f.loss, pp_scatter_gather=f.pp_scatter_gather,
                               tp_overlap_backward=f.tp_overlap_backward, zero1=f.zero1,
                               eta_key=f.efficiency, tp_overlap_matmul=f.tp_overlap_matmul)
