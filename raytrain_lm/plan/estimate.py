"""Step time of a layout; which layouts exist and how they rank; the cluster `train` checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

from raytrain_lm.config.checks import MAX_COUNT, PRECISIONS
from raytrain_lm.config.layout import AC_MODES, PP_SCHEDULES, STRATEGIES, Layout
from raytrain_lm.errors import UserError
from raytrain_lm.models import family, flops_per_token
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan import experts, network
from raytrain_lm.plan.comm import Comm, pp_send_bytes, rank_comm, tp_backward_share
from raytrain_lm.plan.context import cp_sizes
from raytrain_lm.plan.hardware import Cluster
from raytrain_lm.plan.kernels import rank_compute_seconds
from raytrain_lm.plan.memory import MemoryPlan, rank_memory
from raytrain_lm.plan.stages import StageShape, candidate_ranks, held_params, rank_stages


def recompute_flops_per_token(m: ModelConfig, ac: str, seq_len: int,
                              early_stop: bool = True) -> float:
    """Full checkpointing runs every block's forward again (a third of its 6N + 12 L H Q T) but,
    with `early_stop` (torch's checkpoint: it stops recomputing once backward has what it
    needs), its last matmul, whose output backward does not need; op runs every other matmul
    again (the 2nd, 4th, ... of a block, not its last; attention's output is kept); selective
    recomputes elementwise ops only (counted as free)."""
    mms = family(m).block_matmuls(m)
    if ac == "op":
        return 2.0 * m.n_layer * sum(w for i, w in enumerate(mms[:-1]) if i % 2 == 1)
    if ac != "full":
        return 0.0
    block = family(m).active_block(m) - (mms[-1] if early_stop else 0)
    return 2.0 * m.n_layer * block + 4.0 * m.n_layer * m.n_embd * seq_len


def stage_flops_per_token(m: ModelConfig, stages: list[StageShape], ac: str, seq_len: int,
                          early_stop: bool = True) -> float:
    """The FLOPs per token (of its pipeline replica's tokens) that one pp rank's stages run,
    recomputation included: each block's 6 x its matmul weights + 12 H Q T of attention plus its
    share of the recomputation, and on the last stage the head (6 x its weights and the final
    norm's: Family.matmul_params' rest). The ranks' sum is flops_per_token + recompute_flops_per_token;
    a pipeline runs at the pace of its slowest rank (each microbatch passes every stage), and the
    rank with the head does more than the average where the layers are split evenly (Megatron-LM
    of 2021 and torchtitan split layers only, the head on the last stage; parallel/pp.py gives
    any extra layers to the middle stages)."""
    head = flops_per_token(m, seq_len) - m.n_layer * 6.0 * family(m).active_block(m) \
        - 12.0 * m.n_layer * m.n_embd * seq_len
    layer = (flops_per_token(m, seq_len) - head
             + recompute_flops_per_token(m, ac, seq_len, early_stop)) / m.n_layer
    return sum(st.layers * layer + (head if st.last else 0.0) for st in stages)


def bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a pipelined step: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


@dataclass
class Estimate:
    layout: Layout
    memory: MemoryPlan  # the rank that needs the most
    comm: Comm  # the slowest rank's
    compute_s: float  # the slowest pp rank's (its stages' FLOPs: stage_flops_per_token)
    bubble: float
    tp_s: float  # exposed (all of it)
    ep_s: float  # exposed (all of it): a mixture of experts' all-to-alls
    pp_s: float  # exposed: the fill and drain sends, and what the steady state cannot hide
    dp_exposed_s: float
    step_s: float
    mfu: float
    fits: bool
    reserved: float = 0.0  # bytes the caching allocator holds at the peak (memory.total x the allocator factor)
    cp_s: float = 0.0  # exposed (all of it): context parallelism's K/V gathers and their gradients
    compute_parts: Optional[dict] = None  # the slowest rank's compute by part (kernels.py), seconds

    @property
    def bubble_s(self) -> float:
        """Seconds the pipeline bubble adds: (compute + tp + ep) x bubble / (1 - bubble)."""
        busy = self.compute_s + self.tp_s + self.ep_s + self.cp_s
        return busy * self.bubble / (1 - self.bubble) if self.bubble else 0.0


def rank_step(lay: Layout, cl: Cluster, comm: Comm, compute: float, idle: float,
              send_s: float = 0.0) -> tuple[float, ...]:
    """(tp, ep, pp, dp, step, cp) seconds for one rank: what each dimension's traffic adds to
    the step, the part compute does not hide.
    - cp: all of it. Each layer's attention waits for the window's K/V all-gather, and its
      backward reduce-scatters their gradients before the projections' backward can use them
      (parallel/cp.py overlaps nothing: a ring attention would hide the passes behind the
      attention's compute); the pipeline bubble stretches it with compute.
    - tp: all of it. Each all-reduce (or all-gather / reduce-scatter with sequence
      parallelism) sits between two matmuls that need its result (vanilla TP, parallel/tp.py);
      the pipeline bubble stretches it with compute. A framework that hides the backward's
      behind the weight gradients (Cluster.tp_overlap_backward) exposes the rest; one that
      pipelines it with the matmuls forward and backward (Cluster.tp_overlap_matmul,
      Transformer Engine) only what the step's compute does not cover.
    - ep: all of it, as tp: the experts need the tokens the dispatch brings, and the layer's
      output the combine returns (parallel/ep.py overlaps nothing).
    - pp: the sends along the pipeline's fill and drain (the first microbatch's activations
      through every stage boundary, its last gradient back: 2 (v pp - 1) sends of `send_s`),
      plus whatever the steady state's sends take beyond the compute they overlap
      (torch.distributed.pipelining posts them asynchronously; all of them where the
      framework waits for each send, Cluster.overlap_pp False), plus the tied embedding's
      gradient all-reduce after the last microbatch (in comm.pp beyond the sends).
    - dp without a pipeline: gathers and gradient reductions overlap the compute (FSDP2
      prefetches its gathers, DDP and FSDP2 reduce buckets or blocks during backward), up to the
      compute time (zero1 is FSDP2's: its one gather a step is prefetched). With a pipeline the
      gathers overlap, the reductions (after the last microbatch) do not; nor do they where the
      framework reduces after backward (Cluster.overlap_reduce False).
    - a framework's ZeRO-1 on whole replicas (Cluster.zero1): the gradients are reduced after
      backward and the updated parameters gathered after the optimizer step, nothing to overlap
      either with: all of both."""
    t_tp = comm.tp / network.bandwidth(cl, lay, "tp")
    if cl.tp_overlap_matmul:  # pipelined with the matmuls, forward and backward (Transformer Engine)
        t_tp = max(0.0, t_tp - compute)
    elif cl.tp_overlap_backward:
        t_tp *= 1 - tp_backward_share(lay)
    t_ep = comm.ep / network.bandwidth(cl, lay, "ep") if comm.ep else 0.0
    t_cp = comm.cp / network.bandwidth(cl, lay, "cp") if comm.cp else 0.0
    bw_pp = network.bandwidth(cl, lay, "pp")
    t_pp = 0.0
    if lay.pp > 1:
        chain = 2 * (lay.v * lay.pp - 1) * send_s
        sends = (comm.pp - comm.pp_tied) / bw_pp
        hidden = max(0.0, sends - chain - compute) if cl.overlap_pp else sends - chain
        t_pp = chain + hidden + comm.pp_tied / bw_pp
    bw_dp = network.bandwidth(cl, lay, "dp")
    gather, reduce = comm.dp_gather / bw_dp, comm.dp_reduce / bw_dp
    if lay.sharded and not cl.shards_params(lay):
        exposed = gather + reduce
    elif not cl.overlap_reduce:
        exposed = reduce + max(0.0, gather - compute)
    elif lay.pp > 1:
        exposed = max(0.0, gather - compute) + reduce
    else:
        exposed = max(0.0, gather + reduce - compute)
    return t_tp, t_ep, t_pp, exposed, (compute + t_tp + t_ep + t_cp) / (1 - idle) + t_pp + exposed, t_cp


def estimate_layout(m: ModelConfig, lay: Layout, cl: Cluster, time_unfit: bool = True) -> Estimate:
    """The layout's memory and step time (`time_unfit` False: a layout that does not fit gets no
    step time, infinite, which spares the search of layouts that only need the fitting ones)."""
    from raytrain_lm.plan.calibration import constant

    ranks = rank_stages(m, lay.pp, lay.v)
    candidates = candidate_ranks(ranks)
    memory = max((rank_memory(m, lay, cl, ranks[r], r) for r in candidates), key=lambda x: x.total)
    reserved = memory.total * (constant("allocator") if cl.gpu else 1.0)
    if not time_unfit and reserved > cl.budget:
        return Estimate(layout=lay, memory=memory, comm=Comm(), compute_s=math.inf, bubble=0.0,
                        tp_s=0.0, ep_s=0.0, pp_s=0.0, dp_exposed_s=0.0, step_s=math.inf, mfu=0.0, fits=False,
                        reserved=reserved)
    tokens = lay.dp * lay.sequences * lay.seq_len
    model_flops = flops_per_token(m, lay.seq_len) * tokens
    replica_tokens = lay.sequences * lay.seq_len / lay.cp  # one pipeline replica's, split over tp (a cp rank's share)
    idle = bubble(lay.pp, lay.microbatches, lay.v) if lay.pp > 1 else 0.0
    send_s = pp_send_bytes(m, lay, cl) / network.bandwidth(cl, lay, "pp") if lay.pp > 1 else 0.0
    p = family(m).tp_counts(m, lay.tp)
    slowest = None
    for r in candidates:
        if cl.efficiency is not None:  # --compute-efficiency: the step's FLOPs at a constant rate
            work = stage_flops_per_token(m, ranks[r], lay.ac, lay.seq_len, cl.recompute_early_stop)
            parts = {"total": work * replica_tokens / (lay.tp * cl.tflops * 1e12 * cl.efficiency)}
        else:
            ex = experts.held_experts(m, ranks[r])
            parts = rank_compute_seconds(m, lay, cl, ranks[r], experts.spread(
                held_params(p, ranks[r]) - ex, ex, lay, lay.optimizer_shards))
        comm = rank_comm(m, lay, cl, ranks[r])
        times = rank_step(lay, cl, comm, parts["total"], idle, send_s)
        if slowest is None or times[4] > slowest[2][4]:
            slowest = (comm, parts, times)
    comm, parts, (t_tp, t_ep, t_pp, exposed, step, t_cp) = slowest
    return Estimate(layout=lay, memory=memory, comm=comm, compute_s=parts["total"], bubble=idle,
                    tp_s=t_tp, ep_s=t_ep, pp_s=t_pp, dp_exposed_s=exposed, step_s=step,
                    mfu=model_flops / (step * lay.gpus * cl.tflops * 1e12),
                    fits=reserved <= cl.budget, reserved=reserved, compute_parts=parts, cp_s=t_cp)


# ---------------------------------------------------------------- which layouts

def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, found up to its square root."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_sizes(m: ModelConfig, cl: Cluster) -> list[int]:
    """Tensor-parallel degrees that keep a group inside a node and whole heads on each rank."""
    return [t for t in divisors(cl.node) if cl.gpus % t == 0 and whole_heads(m, t)
            and m.block_size % t == 0]


def whole_heads(m: ModelConfig, tp: int) -> bool:
    """Each tp rank holds whole query heads and whole key/value heads (Family.check_layout)."""
    return family(m).check_layout(m, tp) is None


def micro_batches(sequences: int) -> list[int]:
    """Micro-batch sizes tried: the powers of two dividing S, and S."""
    out = {sequences}
    b = 1
    while b <= sequences:
        if sequences % b == 0:
            out.add(b)
        b *= 2
    return sorted(out)


def virtual_stage_counts(m: ModelConfig, pp: int, fixed: Optional[int] = None) -> list[int]:
    """Stages per GPU tried with the interleaved schedule: `fixed` if given, else every v from 2
    to 8 whose pp x v stages the layers fill. Where they do not divide evenly the extra layers go
    to the middle stages (config.layout.split_layers: the first and last, which also hold the
    embedding and the head, are the short ones) and the pipeline runs at its slowest rank's pace."""
    if fixed is not None:
        return [fixed] if pp * fixed <= m.n_layer else []
    return [v for v in range(2, 9) if pp * v <= m.n_layer]


def structures(m: ModelConfig, cl: Cluster, seq_len: int, tp: Optional[int] = None,
               pp: Optional[int] = None, strategy: Optional[str] = None,
               virtual_stages: Optional[int] = None) -> Iterator[tuple]:
    """(tp, pp, dp, strategy, ac, sp, schedule, v) for every layout the GPUs and model allow;
    tp, pp, strategy and the interleaved schedule's stages per GPU fixed when given."""
    for t in [tp] if tp else tp_sizes(m, cl):
        for p in [pp] if pp else [d for d in divisors(cl.gpus // t) if d <= m.n_layer]:
            if cl.gpus % (t * p):
                continue
            dp = cl.gpus // (t * p)
            kinds = [strategy] if strategy else Layout.strategies(dp, t, p)
            schedules = []
            if p > 1:
                for name in PP_SCHEDULES:
                    if name == "interleaved-1f1b":
                        schedules += [(name, v) for v in virtual_stage_counts(m, p, virtual_stages)]
                    elif virtual_stages is None:
                        schedules.append((name, 1))
            else:
                schedules = [("-", 1)]
            sps = [False, True] if t > 1 and seq_len % t == 0 else [False]
            for kind in kinds:
                for ac in AC_MODES:
                    for sp in sps:
                        for schedule, v in schedules:
                            yield t, p, dp, kind, ac, sp, schedule, v


def variants(structure: tuple, global_batch: int, seq_len: int,
             micro_batch: Optional[int] = None, ep: int = 1, cp: int = 1) -> Iterator[Layout]:
    """The micro-batch splits of one structure (check_layout's rules for pipelines), with `ep`
    expert-parallel ranks and `cp` context-parallel ones (out of the structure's dp): any global
    batch that dp divides; only `micro_batch` when given (any size that divides S)."""
    t, p, dp, kind, ac, sp, schedule, v = structure
    dp //= cp
    if global_batch % dp:
        return
    sequences = global_batch // dp
    sizes = micro_batches(sequences) if micro_batch is None else \
        [micro_batch] if sequences % micro_batch == 0 else []
    for b in sizes:
        n = sequences // b
        if p > 1 and (n < p or (schedule == "interleaved-1f1b" and n % p)):
            continue
        yield Layout(dp, t, p, kind, ac, sp, schedule, b, n, seq_len, v if v > 1 else 2, ep, cp)


def _bucket(seconds: float) -> int:
    """Step times within 0.1% count as equal when ranking."""
    return round(math.log(seconds) / math.log(1.001))


def best_variant(estimates: list[Estimate]) -> Estimate:
    """The fastest split that fits, larger micro-batches first among equals (the model does not
    see their better kernel efficiency); if none fits, the one that needs the least memory."""
    fitting = [e for e in estimates if e.fits]
    if fitting:
        return min(fitting, key=lambda e: (_bucket(e.step_s), -e.layout.micro_batch))
    return min(estimates, key=lambda e: e.reserved)


def rank_key(e: Estimate) -> tuple:
    """Fitting layouts by step time, then the simpler (less recomputation, no sequence
    parallelism, ddp, fewer stages, less tp), then memory; the others after, by memory."""
    lay = e.layout
    if not e.fits:
        return (1, e.memory.total)
    return (0, _bucket(e.step_s), AC_MODES.index(lay.ac), lay.sp, list(STRATEGIES).index(lay.strategy),
            lay.pp, lay.v, lay.tp, lay.ep, lay.cp, e.memory.total)


def plan(m: ModelConfig, cl: Cluster, global_batch: int, seq_len: int, tp: Optional[int] = None,
         pp: Optional[int] = None, strategy: Optional[str] = None,
         virtual_stages: Optional[int] = None, ep: Optional[int] = None,
         cp: Optional[int] = None) -> list[Estimate]:
    """Every layout (each with its best micro-batch split), ranked: fitting ones fastest first.
    A mixture of experts' layouts come with each expert-parallel degree dp and its experts allow
    (`ep`: that one); long sequences' with each context-parallel degree (`cp`: that one)."""
    check_request(m, cl, global_batch, seq_len, tp, pp, strategy, virtual_stages, ep)
    out = []
    for structure in structures(m, cl, seq_len, tp, pp, strategy, virtual_stages):
        for e in experts.ep_sizes(m, structure[2], ep):
            for c in cp_sizes(structure, seq_len, e, cp):
                # a split that does not fit is timed only if none fits (best_variant's rule)
                estimates = [estimate_layout(m, lay, cl, time_unfit=False)
                             for lay in variants(structure, global_batch, seq_len, ep=e, cp=c)]
                if estimates:
                    best = best_variant(estimates)
                    out.append(best if best.fits else estimate_layout(m, best.layout, cl))
    if not out:
        raise UserError(f"no layout of {cl.gpus} GPUs can split a global batch of {global_batch} "
                        f"sequences: change --global-batch (or --batch-size / --grad-accum), or "
                        f"drop --tp/--pp/--virtual-stages")
    return sorted(out, key=rank_key)


def check_cluster(cl: Cluster) -> None:
    """Bad cluster inputs of `plan`, one line each."""
    for name, value in (("--gpus", cl.gpus), ("--gpus-per-node", cl.gpus_per_node)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
        if value > MAX_COUNT:  # the layouts' search is over the divisors of the GPUs
            raise UserError(f"{name} must be at most {MAX_COUNT:,}, got {value:,}")
    if cl.gpus > cl.gpus_per_node and cl.gpus % cl.gpus_per_node:
        raise UserError(f"--gpus {cl.gpus} is not a whole number of nodes of --gpus-per-node "
                        f"{cl.gpus_per_node}")
    for name, value in (("--gpu-memory-gb", cl.memory_gb), ("--intra-node-gbps", cl.intra_gbps),
                        ("--inter-node-gbps", cl.inter_gbps), ("--gpu-tflops", cl.tflops),
                        ("--hbm-tbps", cl.hbm_tbps)):
        if not 0 < value < math.inf:
            raise UserError(f"{name} must be positive and finite, got {value:g}")
    for name, value in (("--compute-efficiency", cl.efficiency), ("--peak-fraction", cl.peak_fraction)):
        if value is not None and not 0 < value <= 1:
            raise UserError(f"{name} must be in (0, 1], got {value:g}")
    if cl.precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, got {cl.precision!r}")


def check_request(m: ModelConfig, cl: Cluster, global_batch: int, seq_len: int,
                  tp: Optional[int], pp: Optional[int], strategy: Optional[str],
                  virtual_stages: Optional[int] = None, ep: Optional[int] = None) -> None:
    """Bad inputs of `plan`, one line each."""
    check_cluster(cl)
    if ep is not None:
        problem = family(m).check_layout(m, 1, ep) if ep >= 1 else f"--ep must be at least 1, got {ep}"
        if problem:
            raise UserError(problem)
    if global_batch < 1:
        raise UserError(f"the global batch must be at least 1 sequence, got {global_batch}")
    if strategy is not None and strategy not in STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy is not None and STRATEGIES[strategy].plain_only and ((tp or 1) > 1 or (pp or 1) > 1):
        raise UserError(f"--strategy {strategy} works with --tp 1 --pp 1; use zero2 or fsdp "
                        f"with --tp/--pp")
    if virtual_stages is not None and virtual_stages < 2:
        raise UserError(f"--virtual-stages must be at least 2 (stages per GPU of "
                        f"interleaved-1f1b), got {virtual_stages}")
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
    if not whole_heads(m, tp) or m.block_size % tp:
        kv = f", model.n_kv_head ({m.kv_heads})" if m.n_kv_head is not None else ""
        raise UserError(f"--tp {tp} must divide model.n_head ({m.n_head}){kv} and model.block_size "
                        f"({m.block_size}): each tensor-parallel rank holds whole heads")


def check_pp(m: ModelConfig, cl: Cluster, pp: int, tp: int) -> None:
    if pp < 1:
        raise UserError(f"--pp must be at least 1, got {pp}")
    if cl.gpus % (tp * pp):
        raise UserError(f"--gpus {cl.gpus} is not a multiple of tp x pp = {tp} x {pp}")
    if pp > m.n_layer:
        raise UserError(f"--pp {pp} is more stages than model.n_layer ({m.n_layer}) layers")


def estimate(m: ModelConfig, workers: int, strategy: str, ac: str, micro_batch: int, seq_len: int,
             gpu: bool = True) -> MemoryPlan:
    """Memory of plain data parallelism (no tp, no pp, one micro-step): bench/memory.py's plan."""
    lay = Layout(workers, 1, 1, strategy, ac, False, "-", micro_batch, 1, seq_len)
    return estimate_layout(m, lay, Cluster(gpus=workers, gpu=gpu)).memory
