"""Which layout to train a GPT with: per-GPU memory, per-step communication and an estimated step
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
  parallelism everything divides by tp. Full checkpointing keeps each block's input (the fp32
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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

from raytrain_lm.config import ModelConfig, PP_SCHEDULES, split_layers
from raytrain_lm.errors import UserError

GB = 1e9
USABLE_FRACTION = 0.9
# Defaults of the cluster (H100 SXM nodes of 8 GPUs):
# NVLink 4: 900 GB/s per GPU both directions together = 450 GB/s = 3600 Gb/s per direction.
H100_NVLINK_GBPS = 3600.0
# One 400 Gb/s InfiniBand (or RoCE) NIC per GPU, as in DGX H100 and Meta's Grand Teton hosts.
IB_400_GBPS = 400.0
H100_TFLOPS = 989.0  # H100 SXM dense bf16 (gpus.py)
COMPUTE_EFFICIENCY = 0.5
GPUS_PER_NODE = 8

# Activation elements per layer per token, in units of the width: (whole on every tp rank without
# sequence parallelism, divided by tp). Sums: 17 without recomputation, 11 selective.
AC_SPLIT = {"none": (5, 12), "selective": (3, 8)}
AC_MODES = ("none", "selective", "full")
STRATEGIES = ("ddp", "fsdp")


# ---------------------------------------------------------------- what is planned

@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = GPUS_PER_NODE
    memory_gb: float = 80.0
    intra_gbps: float = H100_NVLINK_GBPS  # per GPU per direction, gigabits per second
    inter_gbps: float = IB_400_GBPS
    tflops: float = H100_TFLOPS  # peak per GPU
    efficiency: float = COMPUTE_EFFICIENCY  # of the peak, reached by the matmuls
    gpu: bool = True  # False: CPU workers (fp32 activations)

    @property
    def budget(self) -> float:
        """Bytes a GPU may plan for."""
        return self.memory_gb * GB * USABLE_FRACTION

    @property
    def act_bytes(self) -> int:
        """Activations, gathered FSDP parameters, tp collectives: bf16 on GPU, fp32 on CPU."""
        return 2 if self.gpu else 4

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


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    strategy: str  # of the dp dimension: ddp or fsdp
    ac: str  # activation checkpointing: none, selective, full
    sp: bool  # sequence parallelism
    schedule: str  # gpipe, 1f1b, interleaved-1f1b; "-" without pp
    micro_batch: int  # b: sequences per micro-batch
    microbatches: int  # n: pipeline microbatches (pp > 1), else gradient-accumulation steps
    seq_len: int

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def v(self) -> int:
        """Pipeline stages per GPU."""
        return 2 if self.schedule == "interleaved-1f1b" else 1

    @property
    def sequences(self) -> int:
        """S: sequences per data-parallel rank per step."""
        return self.micro_batch * self.microbatches

    @property
    def sharded(self) -> bool:
        """FSDP shards only over a dp dimension of 2 or more (fsdp.apply_dp)."""
        return self.strategy == "fsdp" and self.dp > 1

    @property
    def blocks(self) -> dict[str, int]:
        """Each dimension's groups as aligned blocks of consecutive ranks (parallel/mesh.py)."""
        return {"tp": self.tp, "dp": self.dp * self.tp, "pp": self.gpus}

    def flags(self) -> str:
        """This layout as `train` flags (the data-parallel size follows from --workers)."""
        out = [f"--tp {self.tp}", f"--pp {self.pp}", f"--strategy {self.strategy}",
               f"--activation-checkpointing {self.ac}"]
        if self.sp:
            out.append("--sequence-parallel")
        if self.pp > 1:
            out += [f"--pp-schedule {self.schedule}", f"--batch-size {self.sequences}",
                    f"--microbatches {self.microbatches}"]
        else:
            out += [f"--batch-size {self.micro_batch}", f"--grad-accum {self.microbatches}"]
        return " ".join(out)


# ---------------------------------------------------------------- parameters

def param_counts(m: ModelConfig) -> dict[str, int]:
    h, V, L = m.n_embd, m.vocab_size or 256, m.n_layer
    bias = 1 if m.bias else 0
    block = 12 * h * h + bias * (3 * h + h + 4 * h + h) + (2 + 2 * bias) * h
    root = V * h + m.block_size * h + (1 + bias) * h  # tied embedding, positions, final norm
    return {"block": block, "root": root, "total": L * block + root}


def tp_param_counts(m: ModelConfig, tp: int) -> dict[str, float]:
    """Parameters one tp rank holds, per piece (parallel/tp.py's layouts)."""
    h, V, T = m.n_embd, m.vocab_size or 256, m.block_size
    bias = 1 if m.bias else 0
    ln = (1 + bias) * h
    # Split: c_attn (3h x h + 3h), c_fc (4h x h + 4h), attn.c_proj (h x h), mlp.c_proj (h x 4h).
    # Whole: the row-parallel biases (h each) and the two LayerNorms.
    block = (12 * h * h + bias * 7 * h) / tp + bias * 2 * h + 2 * ln
    return {"block": block, "wte": V * h / tp, "wpe": T * h / tp, "ln_f": ln}


@dataclass(frozen=True)
class Stage:
    layers: int
    first: bool
    last: bool


def rank_stages(m: ModelConfig, pp: int, v: int) -> list[list[Stage]]:
    """Each pp rank's stages: stage s on rank s % pp ("loop" placement, parallel/pp.py)."""
    n = pp * v
    sizes = [len(r) for r in split_layers(m.n_layer, n)]
    return [[Stage(sizes[s], s == 0, s == n - 1) for s in range(r, n, pp)] for r in range(pp)]


def stage_params(p: dict[str, float], st: Stage) -> float:
    """A stage's parameters; wte once when one stage is both first and last (tied to the head)."""
    return (st.layers * p["block"] + (p["wte"] if st.first or st.last else 0)
            + (p["wpe"] if st.first else 0) + (p["ln_f"] if st.last else 0))


def held_params(p: dict[str, float], stages: list[Stage]) -> float:
    return sum(stage_params(p, st) for st in stages)


def root_params(p: dict[str, float], stages: list[Stage]) -> float:
    """Parameters outside the blocks (FSDP's root group) on a rank."""
    return sum(stage_params(p, Stage(0, st.first, st.last)) for st in stages)


def candidate_ranks(ranks: list[list[Stage]]) -> list[int]:
    """The pp ranks that can be the worst: the first (most microbatches in flight, embeddings),
    the last (head, logits), and of the others the first with each layer count (a later rank
    with as many layers holds fewer microbatches and sends as much)."""
    p = len(ranks)
    out = {0, p - 1}
    seen = set()
    for r in range(1, p - 1):
        layers = sum(st.layers for st in ranks[r])
        if layers not in seen:
            seen.add(layers)
            out.add(r)
    return sorted(out)


# ---------------------------------------------------------------- memory

@dataclass
class MemoryPlan:
    """Bytes one GPU holds at its peak, by kind."""
    params: float
    grads: float
    optimizer: float
    gathered: float  # FSDP's unsharded working set
    activations: float
    logits: float

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_state + self.gathered + self.activations + self.logits


def chunks_in_flight(lay: Layout, rank: int) -> int:
    """Stage-microbatches whose activations pp rank `rank` holds at once (torch's schedules)."""
    m, p = lay.microbatches, lay.pp
    if p == 1:
        return 1  # gradient accumulation frees each micro-step's activations in its backward
    if lay.schedule == "gpipe":
        return m
    if lay.schedule == "1f1b":
        return min(m, p - rank)
    rounds = max(1, m // p)  # ScheduleInterleaved1F1B's warmup, plus one forward in steady state
    warmup = min((lay.v - 1) * (m // rounds) + 2 * (p - 1 - rank), lay.v * m)
    return min(warmup + 1, lay.v * m)


def layer_activation_bytes(m: ModelConfig, lay: Layout, cl: Cluster, ac: str) -> float:
    """One layer's saved activations for one micro-batch."""
    tokens, h, t = lay.micro_batch * lay.seq_len, m.n_embd, lay.tp
    if ac == "full":
        return tokens * h * 4 / (t if lay.sp else 1)  # the block input: fp32 residual stream
    whole, split = AC_SPLIT[ac]
    per_token = (whole + split) / t if lay.sp else whole + split / t
    return tokens * h * per_token * cl.act_bytes


def activation_bytes(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[Stage], rank: int) -> float:
    tokens = lay.micro_batch * lay.seq_len
    per_microbatch = 0.0  # all of this rank's stages
    for st in stages:
        per_microbatch += st.layers * layer_activation_bytes(m, lay, cl, lay.ac)
        if st.first:
            per_microbatch += tokens * m.n_embd * 4 / (lay.tp if lay.sp else 1)  # embedding output
    held = chunks_in_flight(lay, rank) / lay.v * per_microbatch
    if lay.ac == "full":  # one block's activations exist again while it is recomputed
        held += layer_activation_bytes(m, lay, cl, "none")
    return held


def logits_bytes(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[Stage]) -> float:
    if not any(st.last for st in stages):
        return 0.0
    elements = lay.micro_batch * lay.seq_len * (m.vocab_size or 256) / lay.tp
    held = lay.microbatches if lay.schedule == "gpipe" else 1
    return elements * (cl.act_bytes + 4 + 4) + (held - 1) * elements * 4


def gathered_bytes(p: dict[str, float], lay: Layout, cl: Cluster, stages: list[Stage]) -> float:
    if not lay.sharded:
        return 0.0
    held = held_params(p, stages)
    if lay.pp > 1:  # stays gathered; unsharded fp32 gradients accumulate over the microbatches
        return held * (cl.act_bytes + 4)
    root = root_params(p, stages)
    working = (2 * p["block"] + root) * cl.act_bytes
    if lay.microbatches > 1:  # every unsharded gradient waits for the last micro-step
        return working + held * 4
    return working + max(p["block"], root) * 4


def rank_memory(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[Stage], rank: int) -> MemoryPlan:
    p = tp_param_counts(m, lay.tp)
    held = held_params(p, stages)
    shard = lay.dp if lay.sharded else 1
    return MemoryPlan(params=4 * held / shard, grads=4 * held / shard, optimizer=8 * held / shard,
                      gathered=gathered_bytes(p, lay, cl, stages),
                      activations=activation_bytes(m, lay, cl, stages, rank),
                      logits=logits_bytes(m, lay, cl, stages))


# ---------------------------------------------------------------- communication

def ring_bytes(op: str, n: int, size: float) -> float:
    """Bytes each of n ranks sends for one collective over `size` bytes (the full tensor), ring
    algorithm."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * size
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * size
    raise ValueError(op)


@dataclass
class Comm:
    """Bytes one GPU sends per step, per mesh dimension."""
    dp_gather: float = 0.0
    dp_reduce: float = 0.0
    tp: float = 0.0
    pp: float = 0.0

    @property
    def dp(self) -> float:
        return self.dp_gather + self.dp_reduce


def dp_comm(p: dict[str, float], lay: Layout, cl: Cluster, stages: list[Stage]) -> tuple[float, float]:
    """(gathers, gradient reduction) of the data-parallel dimension."""
    held = held_params(p, stages)
    if not lay.sharded:
        return 0.0, ring_bytes("all_reduce", lay.dp, 4 * held)
    if lay.pp > 1:
        gathered = held  # once, kept for every microbatch
    else:  # each micro-step: blocks in forward and again in backward, the root stays gathered
        root = root_params(p, stages)
        gathered = lay.microbatches * (2 * (held - root) + root)
    return (ring_bytes("all_gather", lay.dp, cl.act_bytes * gathered),
            ring_bytes("reduce_scatter", lay.dp, 4 * held))


def tp_comm(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[Stage]) -> float:
    if lay.tp == 1:
        return 0.0
    per_layer = 4 + (0 if lay.ac == "none" else 1)  # fwd 2, bwd 2, recomputed attention output
    calls = sum(st.layers * per_layer + st.first + st.last for st in stages)
    size = lay.sequences * lay.seq_len * m.n_embd * cl.act_bytes  # every micro-batch of the step
    return calls * ring_bytes("all_reduce", lay.tp, size)


def pp_comm(m: ModelConfig, p: dict[str, float], lay: Layout, stages: list[Stage]) -> float:
    if lay.pp == 1:
        return 0.0
    sends = sum((not st.last) + (not st.first) for st in stages)  # activations on, gradients back
    activation = lay.micro_batch * lay.seq_len * m.n_embd * 4 / (lay.tp if lay.sp else 1)
    out = lay.microbatches * sends * activation
    if any(st.first or st.last for st in stages):  # the tied embedding's gradient, first + last
        out += ring_bytes("all_reduce", 2, 4 * p["wte"] / (lay.dp if lay.sharded else 1))
    return out


def rank_comm(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[Stage]) -> Comm:
    p = tp_param_counts(m, lay.tp)
    gather, reduce = dp_comm(p, lay, cl, stages)
    return Comm(dp_gather=gather, dp_reduce=reduce, tp=tp_comm(m, lay, cl, stages),
                pp=pp_comm(m, p, lay, stages))


# ---------------------------------------------------------------- time

def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """model.flops_per_token (PaLM: 6N + 12 L H Q T) with N as loop.py counts it: every parameter
    but the position embeddings."""
    n = param_counts(m)["total"] - m.block_size * m.n_embd
    return 6.0 * n + 12.0 * m.n_layer * m.n_embd * seq_len


def recompute_flops_per_token(m: ModelConfig, ac: str, seq_len: int) -> float:
    """Full checkpointing runs every block's forward again (a third of its 6N + 12 L H Q T);
    selective recomputes elementwise ops only (counted as free)."""
    if ac != "full":
        return 0.0
    return 2.0 * m.n_layer * param_counts(m)["block"] + 4.0 * m.n_layer * m.n_embd * seq_len


def bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a pipelined step: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


@dataclass
class Estimate:
    layout: Layout
    memory: MemoryPlan  # the rank that needs the most
    comm: Comm  # the slowest rank's
    compute_s: float
    bubble: float
    tp_s: float
    pp_s: float
    dp_exposed_s: float
    step_s: float
    mfu: float
    fits: bool


def rank_step(lay: Layout, cl: Cluster, comm: Comm, compute: float, idle: float) -> tuple[float, ...]:
    """(tp, pp, exposed dp, step) seconds for one rank."""
    t_tp = comm.tp / cl.bandwidth(lay.blocks["tp"])
    t_pp = comm.pp / cl.bandwidth(lay.blocks["pp"])
    gather = comm.dp_gather / cl.bandwidth(lay.blocks["dp"])
    reduce = comm.dp_reduce / cl.bandwidth(lay.blocks["dp"])
    if lay.pp > 1:
        exposed = max(0.0, gather - compute) + reduce
    else:
        exposed = max(0.0, gather + reduce - compute)
    return t_tp, t_pp, exposed, (compute + t_tp) / (1 - idle) + t_pp + exposed


def estimate_layout(m: ModelConfig, lay: Layout, cl: Cluster) -> Estimate:
    ranks = rank_stages(m, lay.pp, lay.v)
    candidates = candidate_ranks(ranks)
    memory = max((rank_memory(m, lay, cl, ranks[r], r) for r in candidates), key=lambda x: x.total)
    tokens = lay.dp * lay.sequences * lay.seq_len
    model_flops = flops_per_token(m, lay.seq_len) * tokens
    work = model_flops + recompute_flops_per_token(m, lay.ac, lay.seq_len) * tokens
    compute = work / (lay.gpus * cl.tflops * 1e12 * cl.efficiency)
    idle = bubble(lay.pp, lay.microbatches, lay.v) if lay.pp > 1 else 0.0
    slowest = None
    for r in candidates:
        comm = rank_comm(m, lay, cl, ranks[r])
        times = rank_step(lay, cl, comm, compute, idle)
        if slowest is None or times[-1] > slowest[1][-1]:
            slowest = (comm, times)
    comm, (t_tp, t_pp, exposed, step) = slowest
    return Estimate(layout=lay, memory=memory, comm=comm, compute_s=compute, bubble=idle,
                    tp_s=t_tp, pp_s=t_pp, dp_exposed_s=exposed, step_s=step,
                    mfu=model_flops / (step * lay.gpus * cl.tflops * 1e12),
                    fits=memory.total <= cl.budget)


# ---------------------------------------------------------------- which layouts

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_sizes(m: ModelConfig, cl: Cluster) -> list[int]:
    """Tensor-parallel degrees that keep a group inside a node and whole heads on each rank."""
    return [t for t in divisors(cl.node) if cl.gpus % t == 0 and m.n_head % t == 0
            and m.block_size % t == 0]


def micro_batches(sequences: int) -> list[int]:
    """Micro-batch sizes tried: the powers of two dividing S, and S."""
    out = {sequences}
    b = 1
    while b <= sequences:
        if sequences % b == 0:
            out.add(b)
        b *= 2
    return sorted(out)


def structures(m: ModelConfig, cl: Cluster, seq_len: int, tp: Optional[int] = None,
               pp: Optional[int] = None, strategy: Optional[str] = None) -> Iterator[tuple]:
    """(tp, pp, dp, strategy, ac, sp, schedule) for every layout the GPUs and model allow;
    tp, pp and strategy fixed when given."""
    for t in [tp] if tp else tp_sizes(m, cl):
        for p in [pp] if pp else [d for d in divisors(cl.gpus // t) if d <= m.n_layer]:
            if cl.gpus % (t * p):
                continue
            dp = cl.gpus // (t * p)
            kinds = [strategy] if strategy else (list(STRATEGIES) if dp > 1 else ["ddp"])
            schedules = [s for s in PP_SCHEDULES if p * (2 if s == "interleaved-1f1b" else 1)
                         <= m.n_layer] if p > 1 else ["-"]
            sps = [False, True] if t > 1 and seq_len % t == 0 else [False]
            for kind in kinds:
                for ac in AC_MODES:
                    for sp in sps:
                        for schedule in schedules:
                            yield t, p, dp, kind, ac, sp, schedule


def variants(structure: tuple, global_batch: int, seq_len: int) -> Iterator[Layout]:
    """The micro-batch splits of one structure (check_layout's rules for pipelines)."""
    t, p, dp, kind, ac, sp, schedule = structure
    if global_batch % dp:
        return
    sequences = global_batch // dp
    for b in micro_batches(sequences):
        n = sequences // b
        if p > 1 and (n < p or (schedule == "interleaved-1f1b" and n % p)):
            continue
        yield Layout(dp, t, p, kind, ac, sp, schedule, b, n, seq_len)


def _bucket(seconds: float) -> int:
    """Step times within 0.1% count as equal when ranking."""
    return round(math.log(seconds) / math.log(1.001))


def best_variant(estimates: list[Estimate]) -> Estimate:
    """The fastest split that fits, larger micro-batches first among equals (the model does not
    see their better kernel efficiency); if none fits, the one that needs the least memory."""
    fitting = [e for e in estimates if e.fits]
    if fitting:
        return min(fitting, key=lambda e: (_bucket(e.step_s), -e.layout.micro_batch))
    return min(estimates, key=lambda e: e.memory.total)


def rank_key(e: Estimate) -> tuple:
    """Fitting layouts by step time, then the simpler (less recomputation, no sequence
    parallelism, ddp, fewer stages, less tp), then memory; the others after, by memory."""
    lay = e.layout
    if not e.fits:
        return (1, e.memory.total)
    return (0, _bucket(e.step_s), AC_MODES.index(lay.ac), lay.sp, lay.strategy == "fsdp",
            lay.pp, lay.tp, e.memory.total)


def plan(m: ModelConfig, cl: Cluster, global_batch: int, seq_len: int, tp: Optional[int] = None,
         pp: Optional[int] = None, strategy: Optional[str] = None) -> list[Estimate]:
    """Every layout (each with its best micro-batch split), ranked: fitting ones fastest first."""
    check_request(m, cl, global_batch, seq_len, tp, pp, strategy)
    out = []
    for structure in structures(m, cl, seq_len, tp, pp, strategy):
        estimates = [estimate_layout(m, lay, cl) for lay in variants(structure, global_batch, seq_len)]
        if estimates:
            out.append(best_variant(estimates))
    if not out:
        raise UserError(f"no layout of {cl.gpus} GPUs can split a global batch of {global_batch} "
                        f"sequences: raise --batch-size or --grad-accum, or drop --tp/--pp")
    return sorted(out, key=rank_key)


def check_cluster(cl: Cluster) -> None:
    """Bad cluster inputs of `plan`, one line each."""
    for name, value in (("--gpus", cl.gpus), ("--gpus-per-node", cl.gpus_per_node)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    if cl.gpus > cl.gpus_per_node and cl.gpus % cl.gpus_per_node:
        raise UserError(f"--gpus {cl.gpus} is not a whole number of nodes of --gpus-per-node "
                        f"{cl.gpus_per_node}")
    for name, value in (("--gpu-memory-gb", cl.memory_gb), ("--intra-node-gbps", cl.intra_gbps),
                        ("--inter-node-gbps", cl.inter_gbps), ("--gpu-tflops", cl.tflops)):
        if not value > 0:
            raise UserError(f"{name} must be positive, got {value:g}")
    if not 0 < cl.efficiency <= 1:
        raise UserError(f"--compute-efficiency must be in (0, 1], got {cl.efficiency:g}")


def check_request(m: ModelConfig, cl: Cluster, global_batch: int, seq_len: int,
                  tp: Optional[int], pp: Optional[int], strategy: Optional[str]) -> None:
    """Bad inputs of `plan`, one line each."""
    check_cluster(cl)
    if global_batch < 1:
        raise UserError(f"the global batch must be at least 1 sequence, got {global_batch}")
    if strategy is not None and strategy not in STRATEGIES:
        raise UserError(f"--strategy must be ddp or fsdp, got {strategy!r}")
    if tp is not None:
        check_tp(m, cl, tp, seq_len)
    if pp is not None:
        check_pp(m, cl, pp, tp or 1)


def check_tp(m: ModelConfig, cl: Cluster, tp: int, seq_len: int) -> None:
    if tp < 1:
        raise UserError(f"--tp must be at least 1, got {tp}")
    if cl.gpus % tp:
        raise UserError(f"--tp {tp} does not divide --gpus {cl.gpus}")
    if tp > cl.node or cl.node % tp:
        raise UserError(f"--tp {tp} does not fit in a node of {cl.node} GPUs: tensor parallelism "
                        f"all-reduces activations in every layer and needs the node's links")
    if m.n_head % tp or m.block_size % tp:
        raise UserError(f"--tp {tp} must divide model.n_head ({m.n_head}) and model.block_size "
                        f"({m.block_size}): each tensor-parallel rank holds whole heads")


def check_pp(m: ModelConfig, cl: Cluster, pp: int, tp: int) -> None:
    if pp < 1:
        raise UserError(f"--pp must be at least 1, got {pp}")
    if cl.gpus % (tp * pp):
        raise UserError(f"--gpus {cl.gpus} is not a multiple of tp x pp = {tp} x {pp}")
    if pp > m.n_layer:
        raise UserError(f"--pp {pp} is more stages than model.n_layer ({m.n_layer}) layers")


# ---------------------------------------------------------------- a config's own layout

def config_layout(cfg) -> Layout:
    """The layout a TrainConfig trains with."""
    from raytrain_lm.config import pipeline_microbatches

    dp = cfg.workers // (cfg.tp * cfg.pp)
    if cfg.pp > 1:
        n = pipeline_microbatches(cfg)
        return Layout(dp, cfg.tp, cfg.pp, cfg.strategy, cfg.activation_checkpointing,
                      cfg.sequence_parallel, cfg.pp_schedule, cfg.batch_size // n, n, cfg.seq_len)
    return Layout(dp, cfg.tp, 1, cfg.strategy, cfg.activation_checkpointing,
                  cfg.sequence_parallel, "-", cfg.batch_size, cfg.grad_accum, cfg.seq_len)


def config_cluster(cfg, memory_gb: float) -> Cluster:
    """The cluster `train` checks against: GPUs per node unknown before Ray starts, so the
    largest of 1, 2, 4, 8 that divides the workers (8-GPU nodes)."""
    return Cluster(gpus=cfg.workers, gpus_per_node=math.gcd(cfg.workers, GPUS_PER_NODE),
                   memory_gb=memory_gb, gpu=cfg.use_gpu)


def estimate(m: ModelConfig, workers: int, strategy: str, ac: str, micro_batch: int, seq_len: int,
             gpu: bool = True) -> MemoryPlan:
    """Memory of plain data parallelism (no tp, no pp, one micro-step): bench/memory.py's plan."""
    lay = Layout(workers, 1, 1, strategy, ac, False, "-", micro_batch, 1, seq_len)
    return estimate_layout(m, lay, Cluster(gpus=workers, gpu=gpu)).memory


# ---------------------------------------------------------------- what `plan` shows

def recommendation(ranked: list[Estimate]) -> Optional[Estimate]:
    return ranked[0] if ranked and ranked[0].fits else None


def reason(best: Estimate, ranked: list[Estimate], cl: Cluster) -> str:
    """Why `best`, in one line: where each dimension runs, and what it beats."""
    lay = best.layout

    def where(dim: str) -> str:
        return "inside a node" if cl.inside(lay.blocks[dim]) else "across nodes"

    parts = []
    if lay.tp > 1:
        parts.append(f"TP {lay.tp} {where('tp')}" + (" with sequence parallelism" if lay.sp else ""))
    if lay.pp > 1:
        parts.append(f"PP {lay.pp} {where('pp')} ({lay.schedule}, {lay.microbatches} microbatches, "
                     f"{best.bubble:.0%} bubble)")
    if lay.dp > 1:
        rest = "the remaining" if lay.tp * lay.pp > 1 else "all"
        parts.append(f"{lay.strategy.upper()} over {rest} {lay.dp} ({where('dp')})")
    if lay.ac != "none":
        parts.append(f"{lay.ac} activation checkpointing")
    fitting = [e for e in ranked if e.fits]
    return (f"{', '.join(parts) or 'one GPU'}: fastest of the {len(fitting)} layouts that fit"
            f"{_runner_up(best, fitting)}{_versus_plain(best, ranked)}")


def short(lay: Layout) -> str:
    """A layout in a few words."""
    out = f"tp {lay.tp}, pp {lay.pp}, {lay.strategy} {lay.dp}"
    if lay.pp > 1:
        out += f", {lay.schedule}"
    ckpt = "no checkpointing" if lay.ac == "none" else f"{lay.ac} checkpointing"
    return f"{out}, {ckpt}" + (", SP" if lay.sp else "")


def _runner_up(best: Estimate, fitting: list[Estimate]) -> str:
    if len(fitting) < 2:
        return ""
    nxt = fitting[1]
    slower = nxt.step_s / best.step_s - 1  # within 0.1% the simpler layout ranks first
    return f"; next: {short(nxt.layout)}, " + ("as fast" if abs(slower) < 0.005 else f"{slower:+.0%}")


def _versus_plain(best: Estimate, ranked: list[Estimate]) -> str:
    """How plain data parallelism (no tp, no pp) compares, when it was planned at all."""
    plain = [e for e in ranked if e.layout.tp == e.layout.pp == 1]
    if not plain or any(e is best for e in plain):
        return ""
    if not plain[0].fits:
        return "; data parallelism alone does not fit"
    return f"; data parallelism alone would take {plain[0].step_s / best.step_s:.2g}x as long"


def _row(i: int, e: Estimate) -> str:
    lay, c = e.layout, e.comm
    pipeline = f"{lay.schedule} {e.bubble:.0%}" if lay.pp > 1 else "-"
    return (f"{i:>3} {lay.tp:>3} {lay.pp:>3} {lay.dp:>4}  {lay.strategy:<6}{lay.ac:<10}"
            f"{'yes' if lay.sp else 'no':<4}{pipeline:<21}{f'{lay.micro_batch} x {lay.microbatches}':<10}"
            f"{e.memory.total / GB:>7.1f}{e.step_s:>9.3g}{e.mfu:>6.0%}"
            f"{c.tp / GB:>8.2f}{c.pp / GB:>7.2f}{c.dp / GB:>7.2f}  {'yes' if e.fits else 'no'}")


def format_table(estimates: list[Estimate], start: int = 1) -> str:
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>4}  {'dp as':<6}{'ckpt':<10}{'sp':<4}"
            f"{'pipeline, bubble':<21}{'b x n':<10}{'GB/GPU':>7}{'step s':>9}{'MFU':>6}"
            f"{'tp GB':>8}{'pp GB':>7}{'dp GB':>7}  fits")
    return "\n".join([head, "-" * len(head)] + [_row(start + i, e) for i, e in enumerate(estimates)])


def describe(name: str, n_params: int, global_batch: int, seq_len: int, cl: Cluster,
             ranked: list[Estimate], top: int, show_all: bool) -> str:
    """The text `plan` prints."""
    fitting = sum(e.fits for e in ranked)
    shown = ranked if show_all else ranked[:top]
    lines = [
        f"{name}: {n_params / 1e9:.3f}B parameters; fp32 weights {4 * n_params / GB:.1f} GB, with "
        f"gradients and AdamW states {16 * n_params / GB:.1f} GB",
        f"{cl.gpus} {'GPUs' if cl.gpu else 'workers'}, {cl.node} per node, {cl.memory_gb:g} GB each "
        f"({cl.budget / GB:.1f} usable); global batch {global_batch} x {seq_len} tokens; "
        f"{cl.tflops:g} TFLOP/s peak x {cl.efficiency:g} reached; links {cl.intra_gbps:g} Gb/s in a "
        f"node, {cl.inter_gbps:g} Gb/s between nodes (per GPU per direction)",
        f"{len(shown)} of {len(ranked)} layouts ({fitting} fit; --all or --json for all); b x n: "
        f"micro-batch x micro-batches per step (pipeline microbatches with pp, else accumulation); "
        f"GB sent per GPU per step:",
        format_table(shown),
    ]
    best = recommendation(ranked)
    if best is None:
        lines.append("recommendation: nothing fits; add GPUs, use GPUs with more memory, or lower "
                     "--batch-size / --seq-len")
    else:
        lines.append(f"recommendation: {best.layout.flags()} (~{best.memory.total / GB:.1f} GB per "
                     f"GPU, ~{best.step_s:.3g} s per step, ~{best.mfu:.0%} MFU)")
        lines.append(f"why: {reason(best, ranked, cl)}")
    lines.append("assumptions: raytrain_lm/plan.py; comparisons with published runs: docs/planner.md")
    return "\n".join(lines)


def estimate_json(e: Estimate) -> dict:
    return {**asdict(e.layout), "flags": e.layout.flags(), "fits": e.fits,
            "memory_gb": {**{k: v / GB for k, v in asdict(e.memory).items()},
                          "total": e.memory.total / GB},
            "comm_gb": {"dp": e.comm.dp / GB, "dp_gather": e.comm.dp_gather / GB,
                        "dp_reduce": e.comm.dp_reduce / GB, "tp": e.comm.tp / GB,
                        "pp": e.comm.pp / GB},
            "seconds": {"compute": e.compute_s, "tp": e.tp_s, "pp": e.pp_s,
                        "dp_exposed": e.dp_exposed_s, "step": e.step_s},
            "bubble": e.bubble, "mfu": e.mfu}


def report_json(n_params: int, global_batch: int, seq_len: int, cl: Cluster,
                ranked: list[Estimate]) -> dict:
    best = recommendation(ranked)
    return {"parameters": n_params, "global_batch": global_batch, "seq_len": seq_len,
            "cluster": asdict(cl), "layouts": [estimate_json(e) for e in ranked],
            "recommendation": None if best is None else estimate_json(best),
            "reason": None if best is None else reason(best, ranked, cl)}


def plan_command(cfg, cl: Cluster, tp: Optional[int] = None, pp: Optional[int] = None,
                 strategy: Optional[str] = None, top: int = 10, show_all: bool = False,
                 as_json: bool = False) -> str:
    """`plan`: every layout of `cl` for cfg's model, sequence length and global batch
    (GPUs x --batch-size x --grad-accum: what plain data parallelism would train with), as text or
    JSON."""
    import json

    if top < 1:
        raise UserError(f"--top must be at least 1, got {top}")
    global_batch = cl.gpus * cfg.batch_size * cfg.grad_accum
    ranked = plan(cfg.model, cl, global_batch, cfg.seq_len, tp, pp, strategy)
    n_params = param_counts(cfg.model)["total"]
    if as_json:
        return json.dumps(report_json(n_params, global_batch, cfg.seq_len, cl, ranked), indent=2)
    return describe(cfg.preset, n_params, global_batch, cfg.seq_len, cl, ranked, top, show_all)
