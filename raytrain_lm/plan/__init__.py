"""Which layout to train a GPT or a Llama with: per-GPU memory, per-step communication and an estimated step
time for every (dp, tp, pp) layout that divides the GPUs, and the fastest one that fits. `plan`
prints them; `train` checks its own layout with the same model (preflight.check_memory).

A layout: dp x tp x pp = GPUs, ranks placed as parallel/mesh.py places them (tp innermost, pp
outermost); the data-parallel dimension is ddp (replicas), zero1 (FSDP2 gathering parameters once per
step), zero2 (once per micro-step, kept to backward) or fsdp (FSDP2 shards); activation checkpointing
none, selective, op or full; sequence parallelism (with tp); with pp, the schedule (gpipe, 1f1b, or
interleaved-1f1b with v stages per GPU) and its microbatches; the micro-batch.

Assumptions (stated so a user can check them):

Batch. The global batch B (sequences per step, --global-batch: any number dp divides) is the
same for every layout: each data-parallel rank runs S = B / dp sequences per step as n
micro-batches of b sequences (n: the pipeline's microbatches with pp, gradient-accumulation
steps without).

Memory per GPU (GiB = 2^30 bytes, as cards are sold: --gpu-memory-gb 80 is an 80 GB card), on
the pipeline rank that needs the most:
- Parameters of the rank's pipeline stages (config.split_layers, as parallel/pp.py builds them:
  the first stage also holds wte and wpe, the last its own copy of the tied wte and the final
  LayerNorm), divided by tp as parallel/tp.py shards them: c_attn and c_fc (weights and biases),
  both c_proj weights, wte (vocabulary-parallel) and wpe (positions) split; row-parallel biases
  and LayerNorms replicated.
- A Llama (model.arch llama): every matrix (q, k, v, o, gate, up, down, the embedding and the
  untied head) divided by tp, the RMSNorms whole, no position table; the first stage holds the
  embedding, the last the head and the final norm, and there is no tied gradient to sum.
- fp32 parameters, gradients and AdamW's two moments: 4 + 4 + 8 bytes per parameter; fsdp and
  zero2 and zero1 divide all three by dp (FSDP2 at rest), ddp keeps all of them.
- FSDP2's working set ("gathered"; memory.gathered_bytes), parameters gathered in the
  activation dtype, at the start of backward:
  - fsdp, no pipeline: the current block and the next (prefetched) and the root group
    (gathered at the start of backward, for the head), plus one block's unsharded gradient in the compute dtype and its
    fp32 copy for the reduce-scatter, plus the head's unsharded gradient;
  - zero1, zero2, no pipeline: every parameter of the rank gathered, plus the same gradients;
  - gradient accumulation: also the unsharded fp32 gradient of every parameter, which FSDP2
    keeps between micro-steps while gradient sync is off (ddp.no_sync);
  - pipelined: the stage's parameters stay gathered (reshard_after_forward=False, fsdp.py) and
    torch.distributed.pipelining accumulates their unsharded fp32 gradients until the last
    microbatch.
  DDP keeps nothing extra (gradients are DDP's buckets).
- Activations saved for backward, per layer per token, in the activation dtype (--precision:
  2 bytes in bf16/fp16, 4 in fp32; auto: bf16 on GPU, fp32 on CPU), as Korthikanti et al. 2022 (arXiv
  2205.05198) count them with fused attention (no seq x seq scores): 17 x width without
  recomputation (their 34 sbh bytes). Without sequence
  parallelism 5 of the 17 stay whole on every tp rank (both LayerNorm inputs, the inputs of c_attn
  and c_fc, the dropout masks) and 12 divide by tp (q/k/v, attention output, the MLP's two
  4x-wide tensors). Selective checkpointing keeps 11 (matmul and attention outputs and the block
  input): 3 whole (block input, the two row-parallel c_proj outputs) and 8 divided. With sequence
  parallelism everything divides by tp. A Llama counted the same way (layout.activation_split):
  4 whole (both norm inputs, the inputs of q/k/v and of the MLP) and 2 + 2 kv/H + 4 f/h divided
  (rotated q and k, v, the attention output; SwiGLU's gate, up, silu(gate) and their product,
  each f wide); selective keeps 3 whole and 2 + 2 kv/H + 2 f/h divided. Op (torchtitan's
  per-op policy: attention's outputs and every other matmul's, parallel/ac.py) keeps the block
  input whole and c_attn's, attention's and c_fc's outputs divided (1 + 8); the Llama's block
  input and down output whole and q, v, attention and gate divided (2 + 1 + kv/H + 1 + f/h),
  plus, while a block runs backward, what it did not keep. Full checkpointing keeps each block's input (in the
  activation dtype; divided by tp with sequence parallelism) plus one block's activations while
  it is recomputed. The first stage also keeps the embedding output.
- Microbatches in flight (activations held at once): no pipeline: 1; gpipe: all m; 1f1b (torch's
  Schedule1F1B): rank r holds min(m, pp - r); interleaved-1f1b (v stages per rank, torch's
  ScheduleInterleaved1F1B): rank r runs min((v-1) m / rounds + 2 (pp-1-r), v m) chunk forwards
  before its first backward and one more in steady state, each chunk one stage's layers (about
  1.4 x 1f1b's memory at pp 8).
- Logits, last stage only: micro-batch x seq x vocab / tp (the loss runs vocabulary-parallel: the
  logits are never gathered) x 12 bytes: the loss's backward holds log_softmax's saved fp32
  output, the fp32 gradient nll_loss hands it and the one it returns (its forward holds less: the
  logits, their fp32 copy, the log-softmax); gpipe
  also keeps the fp32 log-softmax (4 bytes) of every other microbatch in flight.
- Usable: 90% of the GPU's memory (allocator fragmentation, CUDA context, NCCL buffers).

Communication, bytes each GPU sends per step under ring algorithms (all-reduce 2(n-1)/n x size,
all-gather and reduce-scatter (n-1)/n x size), as parallel/traffic.py counts them:
- dp: ddp all-reduces the fp32 gradients of the rank's parameters once per step. fsdp
  all-gathers parameters (activation dtype) in forward and the blocks again in backward, zero2
  once, every micro-step (once per step when pipelined), zero1 once per step, and all three
  reduce-scatter the fp32 gradients once per step.
- tp: per layer per micro-batch, two all-reduces of (b, seq, width) activations in forward and two
  in backward (with sequence parallelism all-gathers and reduce-scatters of the same volume); one
  more when blocks are recomputed (full or selective: the second LayerNorm needs the attention's
  reduced output; torch's checkpoint stops recomputing before the MLP's); one for the
  vocabulary-parallel embedding (first stage) and one for the head's input gradient (last stage).
- pp: per microbatch each stage boundary sends the residual stream forward and its gradient
  backward ((b, seq, width) in the activation dtype; divided by tp with sequence parallelism:
  each tp rank sends its part of the sequence, otherwise every tp rank sends a full copy, as
  torch's pipelining does); the first and the last stage all-reduce the tied embedding's fp32
  gradient.
- A group runs at the intra-node bandwidth when all its ranks lie in one node under the mesh's
  rank mapping (tp: tp consecutive ranks; dp: blocks of dp x tp consecutive ranks; pp: every
  rank), else at the inter-node bandwidth. Bandwidths are per GPU per direction; latency ignored.

Step time:
- Compute: the step's model FLOPs (PaLM: 6 N + 12 L H Q T per token, model.flops_per_token) plus
  recomputation (full: one more forward of every block; op: the 2nd, 4th, ... matmul of each
  block but its last; selective recomputes only elementwise ops, counted as free), on the
  slowest pipeline rank (estimate.stage_flops_per_token: its layers, and on the last the head;
  each microbatch passes every stage) or, without a pipeline, spread evenly over every GPU, at
  --gpu-tflops x the compute efficiency:
  efficiency.py's function of the matmul size (peak_fraction x F / (F + F_HALF), F the FLOPs
  of one h x h/tp matmul of a micro-batch), or --compute-efficiency.
- Overlap (estimate.rank_step): tp traffic is all exposed (vanilla TP: each collective sits
  between matmuls that need it); the pipeline bubble (p-1)/(v m + p-1) (Narayanan et al. 2021)
  stretches compute and tp: (compute + tp) / (1 - bubble); of the pipeline's sends the fill and
  drain (2 (v pp - 1) sends) are exposed and the steady state's overlap compute, the tied
  embedding's all-reduce is exposed; dp traffic overlaps compute up to the compute time without a
  pipeline, and only its gathers with one (torch.distributed.pipelining reduces gradients after
  the last microbatch).
- Not modelled: latency, the optimizer step, data loading, the loss's and the embedding's
  non-matmul work, fp8.
- MFU = model FLOPs / (step time x GPUs x peak).

Which layouts, and in which order:
- tp divides the GPUs of a node (so a tp group never leaves it) and the heads; pp is at most the
  layers (interleaved: v pp, v from 2 to 8 where the stages split the layers evenly, or
  --virtual-stages); dp = GPUs / (tp x pp) must divide the global batch; zero1 only at tp = pp =
  1, zero2 only at pp = 1. Micro-batches
  tried: the powers of two dividing S, and S; pipelines need m >= pp (interleaved: a multiple).
- Each layout keeps its fastest micro-batch split that fits (larger micro-batches among equals).
- Layouts that fit rank by step time; times within 0.1% tie and the simpler wins (less
  recomputation, no sequence parallelism, ddp before zero1, zero2, fsdp, fewer stages, less tp).
Estimates, not measurements: bench/memory.py compares the memory model with measured memory;
docs/planner.md (validation.py, published_runs.json) compares them with published runs.

Modules: layout.py (the cluster, a layout, where the parameters are), memory.py, comm.py,
efficiency.py (the compute efficiency), estimate.py (step time; which layouts exist and how they
rank), printout.py (what `plan` prints, --explain), auto.py (train --layout auto), validation.py
(against published runs).
"""

from raytrain_lm.config.checks import STRATEGIES
from raytrain_lm.config.layout import (
    AC_MODES,
    AC_SPLIT,
    GB,
    GIB,
    GPUS_PER_NODE,
    H100_NVLINK_GBPS,
    H100_TFLOPS,
    IB_400_GBPS,
    PRECISIONS,
    USABLE_FRACTION,
    Cluster,
    Layout,
    Stage,
    activation_split,
    candidate_ranks,
    held_params,
    matmul_params,
    param_counts,
    rank_stages,
    root_params,
    stage_params,
    tp_param_counts,
)
from raytrain_lm.plan.comm import Comm, dp_comm, pp_comm, pp_send_bytes, rank_comm, ring_bytes, tp_comm
from raytrain_lm.plan.efficiency import F_HALF, PEAK_FRACTION, compute_efficiency, matmul_flops
from raytrain_lm.plan.estimate import (
    Estimate,
    best_variant,
    bubble,
    check_cluster,
    check_pp,
    check_request,
    check_tp,
    config_cluster,
    config_layout,
    divisors,
    estimate,
    estimate_layout,
    flops_per_token,
    micro_batches,
    plan,
    rank_key,
    rank_step,
    recompute_flops_per_token,
    strategies,
    structures,
    tp_sizes,
    variants,
    virtual_stage_counts,
    whole_heads,
)
from raytrain_lm.plan.memory import (
    MemoryPlan,
    activation_bytes,
    chunks_in_flight,
    gathered_bytes,
    layer_activation_bytes,
    logits_bytes,
    rank_memory,
)
from raytrain_lm.plan.printout import (
    describe,
    estimate_json,
    explain_text,
    explained,
    format_table,
    parse_layout,
    plan_command,
    reason,
    recommendation,
    report_json,
    short,
)
