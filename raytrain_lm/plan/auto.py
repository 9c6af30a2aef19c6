"""`train --layout auto`: the planner's fastest layout that fits, for the run's workers on the
cluster it will run on, applied to the run's config. No torch, no Ray here: the driver asks Ray
for the cluster's shape (cluster_shape) and passes it in."""

from __future__ import annotations

import math
from typing import Optional

from raytrain_lm.config.layout import Layout
from raytrain_lm.errors import UserError
from raytrain_lm.plan.estimate import Estimate, plan
from raytrain_lm.plan.gpus import kind_of_label
from raytrain_lm.plan.hardware import GIB, Cluster, kind_cluster
from raytrain_lm.plan.kinds import DEFAULT_KIND
from raytrain_lm.plan.printout import reason, recommendation


def auto_cluster(cfg, gpus_per_node: Optional[int], memory_gb: Optional[float],
                 kind: Optional[str] = None) -> Cluster:
    """The cluster --layout auto plans for: --workers GPUs (CPU workers without --use-gpu) of
    `kind` (the GPU Ray reports, cluster_kind; its rates and links; the default kind's when none
    is known, which `kind_text` says),
    `gpus_per_node` of them per node (at most all of them; a count that does not divide the
    workers is taken as its largest divisor that does), `memory_gb` GiB each."""
    if memory_gb is None:
        raise UserError("--layout auto needs the memory per worker: Ray's GPU label does not tell "
                        "it; pass --gpu-memory-gb (GiB, as cards are sold)")
    per_node = min(gpus_per_node or cfg.workers, cfg.workers)
    per_node = math.gcd(per_node, cfg.workers)
    return kind_cluster(kind or DEFAULT_KIND, cfg.workers, gpus_per_node=per_node, memory_gb=memory_gb,
                        gpu=cfg.use_gpu, precision=cfg.precision)


def cluster_kind(nodes: list[dict], memory_gb: Optional[float]) -> Optional[str]:
    """The GPU kind of Ray's live nodes' accelerator label (None: none, several, or unknown)."""
    labels = {key.split(":", 1)[1] for n in nodes if n.get("Alive", True)
              for key in n.get("Resources", {}) if key.startswith("accelerator_type:")}
    return kind_of_label(labels.pop(), memory_gb) if len(labels) == 1 else None


def kind_text(kind: Optional[str], use_gpu: bool) -> str:
    """What `--layout auto` says of the workers it planned for: their GPU kind, or that none is
    known and whose figures stood in (never one kind's silently)."""
    if not use_gpu:
        return "CPU workers"
    return kind or f"a GPU gpu_kinds.json does not know: {DEFAULT_KIND}'s rates assumed"


def trainable(cfg, lay: Layout) -> bool:
    """Whether `train` runs this layout with cfg's other settings (the layout's own rules)."""
    return not lay.problems(cfg.model, cfg.precision, cfg.compile)


def choose_layout(cfg, cl: Cluster) -> tuple[Estimate, str]:
    """(the fastest layout that fits and `train` runs, its one-line reason); a UserError in one
    line where nothing fits."""
    global_batch = cfg.workers * cfg.batch_size * cfg.grad_accum
    ranked = [e for e in plan(cfg.model, cl, global_batch, cfg.seq_len) if trainable(cfg, e.layout)]
    best = recommendation(ranked)
    if best is None:
        least = min((e.memory.total for e in ranked), default=math.inf)
        raise UserError(f"--layout auto: no layout of {cl.gpus} workers fits this model in "
                        f"{cl.memory_gb:g} GiB each (the least needs {least / GIB:.1f} GiB); add "
                        f"workers, use more memory per worker, or lower --batch-size / --seq-len")
    return best, reason(best, ranked, cl)


def cluster_shape(cfg, nodes: list[dict], memory_gb: Optional[float]) -> tuple[Optional[int], Optional[float]]:
    """(GPUs or workers per node, memory per worker in GiB) from Ray's node list (ray.nodes())
    and what the driver knows of the memory; --gpus-per-node and --gpu-memory-gb win. CPU
    workers: as many per node as its CPUs hold at cpus_per_worker."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    if cfg.gpus_per_node:
        per_node = cfg.gpus_per_node
    elif cfg.use_gpu:
        per_node = max((int(r.get("GPU", 0)) for r in alive), default=0) or None
    else:
        per_node = max((int(r.get("CPU", 0) // cfg.cpus_per_worker) for r in alive), default=0) or None
    return per_node, cfg.gpu_memory_gb or memory_gb
