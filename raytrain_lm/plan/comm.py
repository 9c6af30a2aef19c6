"""Bytes each GPU sends per step, per mesh dimension."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_lm.config.layout import Layout
from raytrain_lm.models import family
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan import experts
from raytrain_lm.plan.hardware import Cluster
from raytrain_lm.plan.stages import StageShape, held_params, root_params


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
    pp_tied: float = 0.0  # of pp: the tied embedding's gradient all-reduce (GPT)
    ep: float = 0.0  # a mixture of experts' all-to-alls (plan/experts.py)
    cp: float = 0.0  # context parallelism's all-gathers of K/V and reduce-scatters of their gradients

    @property
    def dp(self) -> float:
        return self.dp_gather + self.dp_reduce


def dp_comm(p: dict[str, float], lay: Layout, cl: Cluster, stages: list[StageShape]) -> tuple[float, float]:
    """(gathers, gradient reduction) of the data-parallel dimension: ddp all-reduces the fp32
    gradients; zero1 gathers the parameters once per step (kept through its micro-steps), zero2
    once per micro-step (kept through backward); fsdp gathers the blocks in forward and again in
    backward; all three reduce-scatter the fp32 gradients once per step (FSDP2, fsdp.apply_dp),
    or each micro-step under Cluster.accumulate "reduce_scatter".
    Pipelined, FSDP2 gathers once per step. A framework's ZeRO-1 on whole replicas
    (Cluster.zero1) reduces the gradients its way and all-gathers the updated parameters in the
    compute dtype, once per step."""
    held = held_params(p, stages)
    n = lay.dp_cp  # the parameters' group: dp, and the cp ranks within each dp rank
    if n == 1:
        return 0.0, 0.0
    g = cl.reduce_bytes
    if not lay.sharded:  # DDP's all-reduce
        return 0.0, ring_bytes("all_reduce", n, g * held)
    if not cl.shards_params(lay):
        return (ring_bytes("all_gather", n, cl.act_bytes * held),
                ring_bytes(cl.zero1, n, g * held))
    if lay.pp > 1 or lay.gathers_once:
        gathered = held  # once, kept for every microbatch
    elif lay.keeps_gathered:
        gathered = lay.microbatches * held
    else:  # each micro-step: blocks in forward and again in backward, the root stays gathered
        root = root_params(p, stages)
        gathered = lay.microbatches * (2 * (held - root) + root)
    # gradients reduce-scattered once per step, or every micro-step where the framework does not
    # hold them unsharded between micro-steps (Cluster.accumulate)
    reductions = lay.microbatches if lay.pp == 1 and cl.accumulate == "reduce_scatter" else 1
    return (ring_bytes("all_gather", n, cl.act_bytes * gathered),
            reductions * ring_bytes("reduce_scatter", n, g * held))


def tp_comm(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[StageShape]) -> float:
    if lay.tp == 1:
        return 0.0
    # fwd 2, bwd 2, and the attention output's again where it is recomputed (op keeps
    # sequence parallelism's reduce-scatters: parallel/ac.py); the MLP's too where full
    # recomputation reruns the whole block (Cluster.recompute_early_stop False)
    again = 0 if lay.ac == "none" or (lay.ac == "op" and lay.sp) else 1
    if lay.ac == "full" and not cl.recompute_early_stop:
        again = 2
    per_layer = 4 + again
    calls = sum(st.layers * per_layer + st.first + st.last for st in stages)
    size = lay.sequences * lay.seq_len / lay.cp * m.n_embd * cl.act_bytes  # every micro-batch of the step
    return calls * ring_bytes("all_reduce", lay.tp, size)


def tp_backward_share(lay: Layout) -> float:
    """The share of a layer's tp collectives that run in backward (2 of 4, or of 5 or 6 with
    recomputation): what a framework overlapping them with the weight gradients hides."""
    again = 0 if lay.ac == "none" else 1
    return 2 / (4 + again)


def pp_send_bytes(m: ModelConfig, lay: Layout, cl: Cluster) -> float:
    """One microbatch's activation (or its gradient) crossing one stage boundary, as each tp rank
    sends it: (b, seq, width) in the activation dtype; with sequence parallelism each tp rank
    holds and sends its part of the sequence, and so does Megatron-LM's scatter/gather
    (Cluster.pp_scatter_gather); otherwise every tp rank sends a full copy."""
    split = lay.sp or cl.pp_scatter_gather
    return lay.micro_batch * lay.seq_len / lay.cp * m.n_embd * cl.act_bytes / (lay.tp if split else 1)


def pp_comm(m: ModelConfig, p: dict[str, float], lay: Layout, cl: Cluster,
            stages: list[StageShape]) -> tuple[float, float]:
    """(all the pipeline's bytes, of which the tied embedding's gradient all-reduce)."""
    if lay.pp == 1:
        return 0.0, 0.0
    sends = sum((not st.last) + (not st.first) for st in stages)  # activations on, gradients back
    out, tied_bytes = lay.microbatches * sends * pp_send_bytes(m, lay, cl), 0.0
    tied = p.get("head") is None  # GPT: the tied embedding's gradient, summed over first + last
    if tied and any(st.first or st.last for st in stages):
        tied_bytes = ring_bytes("all_reduce", 2, 4 * p["wte"] / cl.param_shards(lay))
    return out + tied_bytes, tied_bytes


def window_kv_bytes(m: ModelConfig, lay: Layout, cl: Cluster) -> float:
    """One layer's keys and values of a micro-batch's whole windows, as a tp rank holds them
    (its kv heads): what context parallelism all-gathers into every cp rank."""
    return 2 * lay.micro_batch * lay.seq_len * m.kv_heads * m.head_dim / lay.tp * cl.act_bytes


def cp_comm(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[StageShape]) -> float:
    """Context parallelism (parallel/cp.py): per layer and micro-batch an all-gather of the
    window's K/V in forward, the all-gather again in backward (the attention kept only its
    rank's part, models/attention.py), a reduce-scatter of their gradients, and one more
    all-gather where the layer is recomputed (full checkpointing reruns the attention)."""
    if lay.cp == 1:
        return 0.0
    layers = sum(st.layers for st in stages)
    per_layer = 3 + (lay.ac == "full")
    return lay.microbatches * layers * per_layer * ring_bytes("all_gather", lay.cp, window_kv_bytes(m, lay, cl))


def rank_comm(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[StageShape]) -> Comm:
    p = family(m).tp_counts(m, lay.tp)
    gather, reduce = dp_comm(experts.dense_counts(m, p), lay, cl, stages)
    if experts.block_experts(m):  # routed experts: over edp (the dp ranks holding the same ones)
        e_gather, e_reduce = dp_comm(experts.expert_counts(m, lay), experts.expert_dp(lay), cl, stages)
        gather, reduce = gather + e_gather, reduce + e_reduce
    pp, tied = pp_comm(m, p, lay, cl, stages)
    return Comm(dp_gather=gather, dp_reduce=reduce, tp=tp_comm(m, lay, cl, stages), pp=pp,
                pp_tied=tied, ep=experts.all_to_all_bytes(m, lay, cl.act_bytes, stages),
                cp=cp_comm(m, lay, cl, stages))
