"""Memory per GPU of a layout (the assumptions: docs/planner.md#assumptions)."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_lm.config.layout import Layout
from raytrain_lm.models import family
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan import experts
from raytrain_lm.plan.hardware import Cluster
from raytrain_lm.plan.stages import StageShape, held_params, root_params


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
    """One layer's saved activations for one micro-batch (a cp rank's tokens: 1/cp of them)."""
    tokens, h, t = lay.micro_batch * lay.seq_len / lay.cp, m.n_embd, lay.tp
    if ac == "full":  # the block input, in the run's activation dtype
        return tokens * h * cl.act_bytes / (t if lay.sp else 1)
    whole, split = family(m).activation_split(m, ac)
    # A fused MLP does not save its activation's output; selective's count never had it (it keeps
    # the matmul outputs and recomputes the activation whatever the kernels)
    if cl.kernels == "fused" and ac == "none":
        split -= family(m).fused_mlp_unsaved(m)
    per_token = (whole + split) / t if lay.sp else whole + split / t
    return tokens * h * per_token * cl.act_bytes


def gathered_kv_bytes(m: ModelConfig, lay: Layout, cl: Cluster) -> float:
    """Context parallelism: the K/V of the other cp ranks for one layer's attention, and in its
    backward their gradients (the rank's own K/V are in the activations already). In flight for
    one layer at a time: the attention keeps only its rank's part for backward and gathers the
    rest again there (models/attention.py)."""
    if lay.cp == 1:
        return 0.0
    return 2 * 2 * lay.micro_batch * lay.seq_len * m.kv_heads * m.head_dim / lay.tp * cl.act_bytes * \
        (1 - 1 / lay.cp)


def activation_bytes(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[StageShape], rank: int) -> float:
    tokens = lay.micro_batch * lay.seq_len / lay.cp
    per_microbatch = 0.0  # all of this rank's stages
    for st in stages:
        per_microbatch += st.layers * layer_activation_bytes(m, lay, cl, lay.ac)
        if st.first:
            per_microbatch += tokens * m.n_embd * cl.act_bytes / (lay.tp if lay.sp else 1)  # embedding output
    held = chunks_in_flight(lay, rank) / lay.v * per_microbatch + gathered_kv_bytes(m, lay, cl)
    if lay.ac == "full":  # one block's activations exist again while it is recomputed
        held += layer_activation_bytes(m, lay, cl, "none")
    elif lay.ac == "op":  # and under op what it did not keep (its recomputation runs at once)
        held += layer_activation_bytes(m, lay, cl, "none") - layer_activation_bytes(m, lay, cl, "op")
    return held


def logits_bytes(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[StageShape]) -> float:
    if not any(st.last for st in stages):
        return 0.0
    elements = lay.micro_batch * lay.seq_len / lay.cp * (m.vocab_size or 256) / lay.tp
    held = lay.microbatches if lay.schedule == "gpipe" else 1
    # The loss's peak is the larger of its forward (the logits, their fp32 copy and the fp32
    # log-softmax: the one log_softmax saves) and its backward (that saved output, the gradient
    # nll_loss hands it and the gradient log_softmax returns: three fp32 tensors of the logits'
    # size at once)
    if cl.loss == "fused":  # the logits and their gradient, written in place, in the compute dtype
        return elements * 2 * cl.act_bytes * held
    return elements * max(cl.act_bytes + 4 + 4, 4 + 4 + 4) + (held - 1) * elements * 4


def gathered_bytes(p: dict[str, float], lay: Layout, cl: Cluster, stages: list[StageShape]) -> float:
    """FSDP2's unsharded working set at the peak (the start of backward), as torch's FSDP2 runs:
    - fsdp, no pipeline: the block being computed and the next one, all-gathered ahead
      (FSDP2's implicit prefetch), plus the root group (embeddings, head, final norm), gathered
      at the start of backward (the head's backward comes first; fsdp.py passes
      reshard_after_forward explicitly, so FSDP2's keep-the-root-gathered default does not
      apply, but the peak is the same); in backward one block's unsharded gradient in
      the compute dtype and, with bf16/fp16 compute, its fp32 copy for the reduce-scatter (the
      sharded result is the gradient already counted), plus the head's unsharded gradient (it is
      computed first and reduced with the root group at the end);
    - zero1, zero2 (reshard_after_forward=False), no pipeline: every parameter stays gathered from its
      forward to its backward, so all the rank's parameters, plus the same gradients;
    - gradient accumulation (either): also every parameter's unsharded fp32 gradient, which
      FSDP2 keeps between micro-steps while gradient sync is off (ddp.no_sync); a framework that
      reduce-scatters every micro-step (Cluster.accumulate "reduce_scatter": FSDP1 under
      Composer) keeps only the shard, already counted;
    - pipelined (either): the stage's parameters stay gathered (reshard_after_forward=False,
      fsdp.py) and torch.distributed.pipelining accumulates their unsharded fp32 gradients until
      the last microbatch.
    DDP, and a framework's ZeRO-1 on whole replicas (Cluster.zero1), gather nothing."""
    if not cl.shards_params(lay):
        return 0.0
    a = cl.act_bytes
    held = held_params(p, stages)
    if lay.pp > 1:
        return held * (a + 4)
    root = root_params(p, stages)
    if lay.keeps_gathered:
        working = held * a
    else:
        working = (2 * p["block"] + root) * a
    head = (p.get("head") or p["wte"]) if any(st.last for st in stages) else 0.0
    grads = (p["block"] + head) * a + (p["block"] * 4 if a != 4 else 0)
    if lay.microbatches > 1 and cl.accumulate == "unsharded":  # every gradient waits, unsharded
        return working + held * 4 + p["block"] * a
    return working + grads


def rank_memory(m: ModelConfig, lay: Layout, cl: Cluster, stages: list[StageShape], rank: int) -> MemoryPlan:
    p = family(m).tp_counts(m, lay.tp)
    ex = experts.held_experts(m, stages)  # a mixture of experts' routed experts: over ep first
    dense = held_params(p, stages) - ex
    kept = experts.spread(dense, ex, lay, cl.param_shards(lay))
    # fp32 parameters and gradients (divided by dp under FSDP2: zero1, zero2 and fsdp shard both at
    # rest; not by a framework's ZeRO-1 on whole replicas), AdamW's two fp32 moments (divided by
    # dp for all but ddp)
    return MemoryPlan(params=4 * kept, grads=4 * kept,
                      optimizer=8 * experts.spread(dense, ex, lay, lay.optimizer_shards),
                      gathered=gathered_bytes(experts.gathered_counts(m, p, lay), lay, cl, stages),
                      activations=activation_bytes(m, lay, cl, stages, rank),
                      logits=logits_bytes(m, lay, cl, stages))
