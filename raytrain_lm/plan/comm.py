"""Bytes each GPU sends per step, per mesh dimension."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_lm.config import ModelConfig
from raytrain_lm.plan.layout import Cluster, Layout, Stage, held_params, root_params, tp_param_counts


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
    tied = p.get("head") is None  # GPT: the tied embedding's gradient, summed over first + last
    if tied and any(st.first or st.last for st in stages):
        out += ring_bytes("all_reduce", 2, 4 * p["wte"] / (lay.dp if lay.sharded else 1))
    return out


def rank_comm(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[Stage]) -> Comm:
    p = tp_param_counts(m, lay.tp)
    gather, reduce = dp_comm(p, lay, cl, stages)
    return Comm(dp_gather=gather, dp_reduce=reduce, tp=tp_comm(m, lay, cl, stages),
                pp=pp_comm(m, p, lay, stages))
