"""Which layout to train a GPT or a Llama with: per-GPU memory, per-step communication and an estimated step
time for every (dp, tp, pp) layout that divides the GPUs, and the fastest one that fits. `plan`
prints them; `train` checks its own layout with the same model (preflight.check_memory).

A layout: dp x tp x pp = GPUs, ranks placed as parallel/mesh.py places them (tp innermost, pp
outermost); the data-parallel dimension is ddp (replicas) or fsdp (FSDP2 shards); activation
checkpointing none, selective or full; sequence parallelism (with tp); with pp, the schedule
(gpipe, 1f1b, or interleaved-1f1b with two stages per GPU) and its microbatches; the micro-batch.

Assumptions (stated so a user can check them):

Batch. The global batch B (sequences per step) is the same for every layout: each data-parallel
rank runs S = B / dp sequences per step as n micro-batches of b sequences (n: the pipeline's
microbatches with pp, gradient-accumulation steps without).

Memory per GPU (GB = 1e9 bytes), on the pipeline rank that needs the most:
- Parameters of the rank's pipeline stages (config.split_layers, as parallel/pp.py builds them:
  the first stage also holds wte and wpe, the last its own copy of the tied wte and the final
  LayerNorm), divided by tp as parallel/tp.py shards them: c_attn and c_fc (weights and biases),
  both c_proj weights, wte (vocabulary-parallel) and wpe (positions) split; row-parallel biases
  and LayerNorms replicated.
- A Llama (model.arch llama): every matrix (q, k, v, o, gate, up, down, the embedding and the
  untied head) divided by tp, the RMSNorms whole, no position table; the first stage holds the
  embedding, the last the head and the final norm, and there is no tied gradient to sum.
- fp32 parameters, gradients and AdamW's two moments: 4 + 4 + 8 bytes per parameter; fsdp
  divides them by dp, ddp keeps all of them.
- FSDP's working set ("gathered"), parameters gathered in the activation dtype:
  - no pipeline, one micro-batch per step: two blocks in flight plus the root (embeddings stay
    gathered through a step) and one block's unsharded fp32 gradient before its reduce-scatter;
  - no pipeline, gradient accumulation: the same, plus the unsharded fp32 gradient of every
    parameter, which FSDP2 keeps between micro-steps while gradient sync is off (ddp.no_sync);
  - pipelined: the stage's parameters stay gathered (reshard_after_forward=False, fsdp.py) and
    torch.distributed.pipelining accumulates their unsharded fp32 gradients until the last
    microbatch.
  DDP keeps nothing extra (gradients are its buckets).
- Activations saved for backward, per layer per token, in the activation dtype (2 bytes: bf16 on
  GPU; 4 on CPU), as Korthikanti et al. 2022 (arXiv 2205.05198) count them with fused attention
  (no seq x seq scores): 17 x width without recomputation (their 34 sbh bytes). Without sequence
  parallelism 5 of the 17 stay whole on every tp rank (both LayerNorm inputs, the inputs of c_attn
  and c_fc, the dropout masks) and 12 divide by tp (q/k/v, attention output, the MLP's two
  4x-wide tensors). Selective checkpointing keeps 11 (matmul and attention outputs and the block
  input): 3 whole (block input, the two row-parallel c_proj outputs) and 8 divided. With sequence
  parallelism everything divides by tp. A Llama counted the same way (layout.activation_split):
  4 whole (both norm inputs, the inputs of q/k/v and of the MLP) and 2 + 2 kv/H + 4 f/h divided
  (rotated q and k, v, the attention output; SwiGLU's gate, up, silu(gate) and their product,
  each f wide); selective keeps 3 whole and 2 + 2 kv/H + 2 f/h divided. Full checkpointing keeps each block's input (the fp32
  residual stream; divided by tp with sequence parallelism) plus one block's activations while it
  is recomputed. The first stage also keeps the embedding output (fp32).
- Microbatches in flight (activations held at once): no pipeline: 1; gpipe: all m; 1f1b (torch's
  Schedule1F1B): rank r holds min(m, pp - r); interleaved-1f1b (v = 2 stages per rank, torch's
  ScheduleInterleaved1F1B): rank r runs min((v-1) m / rounds + 2 (pp-1-r), v m) chunk forwards
  before its first backward and one more in steady state, each chunk one stage's layers (about
  1.4 x 1f1b's memory at pp 8).
- Logits, last stage only: micro-batch x seq x vocab / tp (the loss runs vocabulary-parallel: the
  logits are never gathered) in the activation dtype plus an fp32 copy and its gradient; gpipe
  also keeps the fp32 log-softmax (4 bytes) of every other microbatch in flight.
- Usable: 90% of the GPU's memory (allocator fragmentation, CUDA context, NCCL buffers).

Communication, bytes each GPU sends per step under ring algorithms (all-reduce 2(n-1)/n x size,
all-gather and reduce-scatter (n-1)/n x size), as parallel/comm.py counts them:
- dp: ddp all-reduces the fp32 gradients of the rank's parameters once per step. fsdp all-gathers
  parameters (activation dtype) in forward and the blocks again in backward, every micro-step
  (once per step when pipelined), and reduce-scatters the fp32 gradients once per step.
- tp: per layer per micro-batch, two all-reduces of (b, seq, width) activations in forward and two
  in backward (with sequence parallelism all-gathers and reduce-scatters of the same volume); one
  more when blocks are recomputed (full or selective: the second LayerNorm needs the attention's
  reduced output; torch's checkpoint stops recomputing before the MLP's); one for the
  vocabulary-parallel embedding (first stage) and one for the head's input gradient (last stage).
- pp: per microbatch each stage boundary sends the fp32 residual stream forward and its gradient
  backward ((b, seq, width); divided by tp with sequence parallelism: each tp rank sends its part
  of the sequence, otherwise every tp rank sends a full copy); the first and the last stage
  all-reduce the tied embedding's fp32 gradient.
- A group runs at the intra-node bandwidth when all its ranks lie in one node under the mesh's
  rank mapping (tp: tp consecutive ranks; dp: blocks of dp x tp consecutive ranks; pp: every
  rank), else at the inter-node bandwidth. Bandwidths are per GPU per direction; latency ignored.

Step time:
- Compute: the step's model FLOPs (PaLM: 6 N + 12 L H Q T per token, model.flops_per_token) plus
  recomputation (full: one more forward of every block; selective recomputes only elementwise
  ops, counted as free), spread evenly over every GPU at --gpu-tflops x --compute-efficiency (the
  fraction of peak the matmuls reach when nothing waits; 0.5 by default).
- Tensor-parallel communication does not overlap compute; the pipeline bubble (pp-1)/(v m + pp-1)
  (Narayanan et al. 2021) stretches both: (compute + tp) / (1 - bubble).
- Plus the pipeline's point-to-point (not overlapped), plus the data-parallel communication that
  compute does not hide: without a pipeline dp overlaps up to the compute time (FSDP prefetches
  its gathers, DDP all-reduces buckets during backward); with one only the gathers overlap:
  torch.distributed.pipelining reduces gradients after the last microbatch.
- Not modelled: latency, kernel efficiency against micro-batch size, the optimizer step, data
  loading, the extra work of the first and last stages (embedding, head), fp8.
- MFU = model FLOPs / (step time x GPUs x peak).

Which layouts, and in which order:
- tp divides the GPUs of a node (so a tp group never leaves it) and the heads; pp is at most the
  layers (interleaved: 2 pp); dp = GPUs / (tp x pp) must divide the global batch. Micro-batches
  tried: the powers of two dividing S, and S; pipelines need m >= pp (interleaved: a multiple).
- Each layout keeps its fastest micro-batch split that fits (larger micro-batches among equals:
  the model does not see their better kernel efficiency).
- Layouts that fit rank by step time; times within 0.1% tie and the simpler wins (less
  recomputation, no sequence parallelism, ddp, fewer stages, less tp).
Estimates, not measurements: bench/memory.py compares the memory model with measured memory;
docs/planner.md compares step times with published runs.

Modules: layout.py (the cluster, a layout, where the parameters are), memory.py, comm.py,
estimate.py (step time; which layouts exist and how they rank), report.py (what `plan` prints).
"""

from raytrain_lm.plan.layout import (  # noqa: F401
    GB,
    GIB,
    USABLE_FRACTION,
    H100_NVLINK_GBPS,
    IB_400_GBPS,
    H100_TFLOPS,
    GPUS_PER_NODE,
    PRECISIONS,
    AC_SPLIT,
    AC_MODES,
    STRATEGIES,
    Cluster,
    Layout,
    param_counts,
    matmul_params,
    tp_param_counts,
    activation_split,
    Stage,
    rank_stages,
    stage_params,
    held_params,
    root_params,
    candidate_ranks)
from raytrain_lm.plan.memory import (  # noqa: F401
    MemoryPlan,
    chunks_in_flight,
    layer_activation_bytes,
    activation_bytes,
    logits_bytes,
    gathered_bytes,
    rank_memory)
from raytrain_lm.plan.comm import (  # noqa: F401
    ring_bytes,
    Comm,
    pp_send_bytes,
    dp_comm,
    tp_comm,
    pp_comm,
    rank_comm)
from raytrain_lm.plan.estimate import (  # noqa: F401
    flops_per_token,
    recompute_flops_per_token,
    bubble,
    Estimate,
    rank_step,
    estimate_layout,
    divisors,
    tp_sizes,
    whole_heads,
    micro_batches,
    virtual_stage_counts,
    strategies,
    structures,
    variants,
    best_variant,
    rank_key,
    plan,
    check_cluster,
    check_request,
    check_tp,
    check_pp,
    config_layout,
    config_cluster,
    estimate)
from raytrain_lm.plan.report import (  # noqa: F401
    recommendation,
    reason,
    short,
    format_table,
    describe,
    estimate_json,
    report_json,
    parse_layout,
    explained,
    explain_text,
    plan_command)
from raytrain_lm.plan.efficiency import (  # noqa: F401
    F_HALF,
    PEAK_FRACTION,
    matmul_flops,
    compute_efficiency)
