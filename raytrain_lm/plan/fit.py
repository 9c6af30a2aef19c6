"""Whether a run's own layout fits its workers' memory, by the planner's model: `train`'s check
before any worker starts, and each GPU worker's again with the memory its device reports."""

from __future__ import annotations

import math
from typing import Optional

from raytrain_lm.config.layout import Layout
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.config.sizes import fit_to_world, worker_counts
from raytrain_lm.errors import UserError
from raytrain_lm.plan.estimate import estimate_layout, plan
from raytrain_lm.plan.hardware import GIB, Cluster, kind_cluster
from raytrain_lm.plan.kinds import DEFAULT_KIND
from raytrain_lm.plan.kinds import kinds as gpu_kinds
from raytrain_lm.plan.printout import recommendation


def check_memory(cfg: TrainConfig, memory_gb: Optional[float], gpu_kind: Optional[str] = None) -> None:
    """Refuse a configuration whose planned per-worker memory (plan.py, for its own layout: tp,
    pp, strategy, sequence parallelism, schedule and microbatches) exceeds what a worker has,
    naming the plan's best layout for the same workers and global batch on their GPU kind (the
    one the device or Ray's label names, plan/gpus.py). An elastic run is checked at each of its
    sizes (fewer workers hold more of a sharded model each)."""
    if memory_gb is None:
        return
    for size in worker_counts(cfg):  # a fixed run: its one size, as configured
        _check_memory_at(fit_to_world(cfg, size), memory_gb, gpu_kind)


def _check_memory_at(cfg: TrainConfig, memory_gb: float, gpu_kind: Optional[str]) -> None:
    layout, cluster = Layout.of(cfg), config_cluster(cfg, memory_gb, gpu_kind)
    mine = estimate_layout(cfg.model, layout, cluster)
    if mine.fits:
        return
    m = mine.memory
    raise UserError(f"this run needs ~{mine.reserved / GIB:.1f} GiB per worker (model state "
                    f"{m.model_state / GIB:.1f}, FSDP working set {m.gathered / GIB:.1f}, activations "
                    f"{m.activations / GIB:.1f}, logits {m.logits / GIB:.1f}, with the allocator's "
                    f"overhead) but a worker has {memory_gb:.0f} GiB ({cluster.budget / GIB:.1f} "
                    f"usable); {_better_layout(cfg, cluster, layout)}; see `python cli.py plan`, or pass --force")


def _better_layout(cfg: TrainConfig, cluster, layout) -> str:
    """The plan's fastest layout that fits, at this run's global batch, as a hint."""
    try:
        best = recommendation(plan(cfg.model, cluster, layout.dp * layout.sequences, cfg.seq_len))
    except UserError:
        best = None
    if best is None:
        return "nothing fits on this many workers: add workers or use a smaller model"
    return f"try {best.layout.flags()} (~{best.reserved / GIB:.1f} GiB per worker)"


def config_cluster(cfg, memory_gb: float, gpu_kind: Optional[str] = None) -> Cluster:
    """The cluster `train` checks against: `memory_gb` per worker, of the GPU kind the worker's
    device or Ray's label names (the default kind's figures where none is known: whether the run
    fits does not depend on them, the ranking of the layout it hints at does); GPUs per node
    unknown before Ray starts, so the largest divisor of the workers a node of the kind holds."""
    key = gpu_kind or DEFAULT_KIND
    return kind_cluster(key, cfg.workers, gpus_per_node=math.gcd(cfg.workers, gpu_kinds()[key].gpus_per_node),
                        memory_gb=memory_gb, gpu=cfg.use_gpu, precision=cfg.precision)
