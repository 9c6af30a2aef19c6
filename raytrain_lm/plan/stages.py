"""Where a model's parameters sit in a pipelined layout: each pp rank's stages (its layers, and
whether it holds the embeddings or the head), and the parameters per stage from its family's
tensor-parallel counts (Family.tp_counts)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from raytrain_lm.config.layout import split_layers
from raytrain_lm.models.family import ModelConfig


@dataclass(frozen=True)
class StageShape:
    layers: int
    first: bool
    last: bool


def rank_stages(m: ModelConfig, pp: int, v: int) -> list[list[StageShape]]:
    """Each pp rank's stages: stage s on rank s % pp ("loop" placement, parallel/pp.py)."""
    return _rank_stages(m.n_layer, pp, v)


@lru_cache(maxsize=4096)
def _rank_stages(n_layer: int, pp: int, v: int) -> list[list[StageShape]]:
    n = pp * v
    sizes = [len(r) for r in split_layers(n_layer, n)]
    return [[StageShape(sizes[s], s == 0, s == n - 1) for s in range(r, n, pp)] for r in range(pp)]


def stage_params(p: dict[str, float], st: StageShape) -> float:
    """A stage's parameters. Tied (no "head"): wte on the first and the last stage, once where
    one stage is both. Untied: wte on the first, the head on the last."""
    head = p.get("head")
    embeddings = p["wte"] if st.first or (st.last and head is None) else 0
    return (st.layers * p["block"] + embeddings + (head if st.last and head else 0)
            + (p["wpe"] if st.first else 0) + (p["ln_f"] if st.last else 0))


def held_params(p: dict[str, float], stages: list[StageShape]) -> float:
    return sum(stage_params(p, st) for st in stages)


def root_params(p: dict[str, float], stages: list[StageShape]) -> float:
    """Parameters outside the blocks (FSDP's root group) on a rank."""
    return sum(stage_params(p, StageShape(0, st.first, st.last)) for st in stages)


def candidate_ranks(ranks: list[list[StageShape]]) -> list[int]:
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
