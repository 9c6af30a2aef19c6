"""Memory per GPU of a layout (the assumptions: plan/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_lm.config import ModelConfig
from raytrain_lm.plan.layout import (Cluster, Layout, Stage, activation_split, held_params,
                                     root_params, tp_param_counts)


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
    whole, split = activation_split(m, ac)
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
