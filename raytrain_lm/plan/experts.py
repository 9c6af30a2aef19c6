"""What a mixture of experts changes in a plan (its family's counts: models/moe/).

- Memory: a block's routed experts (E x 3 h f) are split over ep first, each rank holding E/ep of
  them, and the strategy then shards them over the rest of dp (edp) as it shards everything else
  over dp: at rest a GPU holds dense / n + experts / max(n, ep), n the ranks the strategy spreads
  a dense parameter over (1 or dp; dp >= ep, so under a sharding strategy every parameter is
  1/dp). FSDP's working set gathers a block's experts over edp: E/ep of them.
- FLOPs: a token runs the router, k experts and the shared expert (Family.matmul_params); those
  stay whole on every tp rank (the MoE layer is not tensor-parallel: parallel/tp.py), and each
  expert's matmuls are small: an expert sees b s k ep / E rows of a micro-batch (kernels.py).
- Traffic: every MoE layer sends each of a micro-batch's b s k routed copies of a token to its
  expert's rank and back (dispatch and combine), forward and backward: 4 all-to-alls of
  b s k h values per layer and micro-batch, 6 where full checkpointing reruns the forward; of each,
  (ep - 1) / ep leaves the GPU (routing taken as uniform); a cp rank routes its 1/cp of each
  window. The expert gradients are reduced over edp (x cp), not dp (x cp).
"""

from __future__ import annotations

from dataclasses import replace

from raytrain_lm.config.layout import Layout
from raytrain_lm.models import family
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan.stages import StageShape


def block_experts(m: ModelConfig) -> float:
    """A block's routed experts' parameters (0 for a dense model)."""
    return float(family(m).expert_params(m))


def held_experts(m: ModelConfig, stages: list[StageShape]) -> float:
    """The routed experts' parameters of a rank's stages, all of them (before ep splits them)."""
    return sum(st.layers for st in stages) * block_experts(m)


def spread(dense_held: float, experts_held: float, lay: Layout, shards: int) -> float:
    """Parameters a GPU keeps of `dense_held` + `experts_held` where the strategy spreads each
    dense one over `shards` ranks (module docstring)."""
    return dense_held / shards + experts_held / max(shards, lay.ep)


def gathered_counts(m: ModelConfig, p: dict[str, float], lay: Layout) -> dict[str, float]:
    """The tp counts as FSDP gathers them on one rank: a block's experts, E/ep of them."""
    return {**p, "block": p["block"] - block_experts(m) * (1 - 1 / lay.ep)}


def dense_counts(m: ModelConfig, p: dict[str, float]) -> dict[str, float]:
    return {**p, "block": p["block"] - block_experts(m)}


def expert_counts(m: ModelConfig, lay: Layout) -> dict[str, float]:
    """A rank's experts per block (E/ep of them), nothing outside the blocks."""
    return {"block": block_experts(m) / lay.ep, "wte": 0.0, "wpe": 0.0, "ln_f": 0.0, "head": 0.0}


def expert_dp(lay: Layout) -> Layout:
    """The data-parallel dimension the experts are reduced over: edp = dp / ep (and the cp ranks
    within each: dp_cp of the result)."""
    return replace(lay, dp=lay.dp // lay.ep, ep=1)


def whole_weights(m: ModelConfig) -> float:
    """A block's matmul weights a token uses in its MoE layer (router, k experts, shared expert):
    computed whole on every tp rank."""
    if not block_experts(m):
        return 0.0
    return m.n_experts * m.n_embd + (m.top_k * 3 * m.hidden_dim + 3 * m.shared_ffn_dim) * m.n_embd


def expert_rows(m: ModelConfig, lay: Layout) -> float:
    """Rows one expert's matmuls see per micro-batch, on average (uniform routing; a cp rank
    routes its 1/cp of each window)."""
    return lay.micro_batch * lay.seq_len / lay.cp * m.top_k * lay.ep / m.n_experts


def all_to_all_bytes(m: ModelConfig, lay: Layout, act_bytes: int, stages: list[StageShape]) -> float:
    """Bytes one GPU sends per step in its MoE layers' all-to-alls (module docstring)."""
    if lay.ep == 1 or not block_experts(m):
        return 0.0
    layers = sum(st.layers for st in stages)
    calls = 4 + (2 if lay.ac == "full" else 0)
    one = lay.micro_batch * lay.seq_len / lay.cp * m.top_k * m.n_embd * act_bytes * (lay.ep - 1) / lay.ep
    return lay.microbatches * layers * calls * one


def ep_sizes(m: ModelConfig, dp: int, fixed: int | None = None) -> list[int]:
    """The expert-parallel degrees a plan tries: those that divide dp and the experts (just 1 for
    a dense model); only `fixed` where given and valid."""
    sizes = [e for e in range(1, dp + 1) if dp % e == 0 and family(m).check_layout(m, 1, e) is None]
    return [e for e in sizes if e == fixed] if fixed is not None else sizes
