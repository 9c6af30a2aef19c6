"""The parallel layout's vocabulary, pure Python: its registries (STRATEGIES, the pipeline
schedules, the activation-checkpointing modes) and its settings (LayoutSettings, part of
TrainConfig: `--strategy`, `--tp`, ...). config/layout.py's Layout holds a run's choices among
them and every rule they obey."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_lm.setting import listing, named, setting


@dataclass(frozen=True)
class Strategy:
    """A data-parallel strategy, by what it shards over the dp ranks and how it is built. The
    planner's memory and traffic and parallel/'s builders read these traits, not names."""
    name: str
    title: str  # as `plan` names it
    help: str  # what it does, in --strategy's help
    shards_optimizer: bool  # AdamW's states
    fsdp: bool  # built on FSDP2: parameters and gradients sharded at rest
    keeps_gathered: bool = False  # FSDP2 keeps each micro-step's gathered parameters to backward
    gathers_once: bool = False  # ... and through all of a step's micro-steps
    plain_only: bool = False  # only without tp and pp
    pipelined_as: Optional[str] = None  # with pp it is the same as this one (not planned twice)
    fp16: bool = True  # runs with fp16's gradient scaler


# In the planner's order of preference among equals. A new strategy: one entry here, its builder
# in parallel/ (fsdp.apply_dp or a module of its own), and plan/comm.py if it moves other bytes
# (docs/architecture.md, "Adding a strategy").
STRATEGIES = {s.name: s for s in (
    Strategy("ddp", "DDP", "a full replica per data-parallel rank", shards_optimizer=False,
             fsdp=False),
    Strategy("zero1", "ZeRO-1", "ZeRO-1: gradients reduce-scattered, parameters gathered once per "
             "step; --tp 1 --pp 1", shards_optimizer=True, fsdp=True, keeps_gathered=True,
             gathers_once=True, plain_only=True),
    Strategy("zero2", "ZeRO-2", "gathered once per micro-step, kept from forward to backward",
             shards_optimizer=True, fsdp=True, keeps_gathered=True, pipelined_as="fsdp"),
    Strategy("fsdp", "FSDP", "gathered for each use", shards_optimizer=True, fsdp=True),
)}
# The strategy of a single data-parallel rank, with nothing to shard over: the one sharding nothing.
UNSHARDED = next(s.name for s in STRATEGIES.values() if not s.shards_optimizer and not s.fsdp)
# The pipeline schedules (parallel/pp.py builds them) and the activation-checkpointing modes
# (parallel/ac.py), each with its words for --help.
PP_SCHEDULE_HELP = {"gpipe": "", "1f1b": "", "interleaved-1f1b": "--virtual-stages stages per worker"}
PP_SCHEDULES = tuple(PP_SCHEDULE_HELP)
AC_HELP = {"none": "", "selective": "all but matmul and attention outputs",
           "op": "torchtitan's per-op policy: all but attention outputs and every other matmul's",
           "full": "each block from its input"}
AC_MODES = tuple(AC_HELP)
STRATEGY_HELP = (f"The data-parallel dimension: {listing(named({s.name: s.help for s in STRATEGIES.values()}))}; "
                 f"{listing([s.name for s in STRATEGIES.values() if s.fsdp], 'and')} hold parameters, "
                 f"gradients and AdamW's states sharded over the ranks between steps (FSDP2).")
DEFAULT_VIRTUAL = 2  # stages per worker of interleaved-1f1b when --virtual-stages is 0




@dataclass
class LayoutSettings:
    """How a run's model and batch are split over the workers (Layout.of reads them)."""
    strategy: str = setting("ddp", help=STRATEGY_HELP)
    tp: int = setting(1, help="Tensor-parallel degree: each layer's matrices split over this many "
                      "workers (keep it within a node).")
    pp: int = setting(1, help="Pipeline-parallel degree: the layers split into this many stages.")
    ep: int = setting(1, help="Expert-parallel degree (model.arch moe): each block's experts split "
                      "over this many of the data-parallel ranks, tokens sent to them by all-to-all "
                      "(it divides the experts and the data-parallel size).")
    microbatches: int = setting(0, help="Pipeline microbatches per step (--pp); they split "
                                "--batch-size. 0: 2 x the stages.")
    pp_schedule: str = setting("1f1b", help=f"Pipeline schedule: {listing(named(PP_SCHEDULE_HELP))}.")
    virtual_stages: int = setting(0, help="Stages per worker of --pp-schedule interleaved-1f1b "
                                  "(a smaller bubble, more sends); 0: 2.")
    layout: Optional[str] = setting(None, help="auto: let the planner choose --tp, --pp, "
                                    "--strategy, checkpointing, sequence parallelism, the "
                                    "schedule and the micro-batches for --workers on the "
                                    "cluster Ray reports (GPUs per node, GPU memory; or "
                                    "--gpus-per-node, --gpu-memory-gb); the global batch stays "
                                    "workers x batch-size x grad-accum.")
    gpus_per_node: Optional[int] = setting(None, help="GPUs (workers) per node for --layout auto "
                                           "[default: what Ray reports].")
    sequence_parallel: bool = setting(False, help="With --tp: shard LayerNorm and dropout "
                                      "activations over the sequence too.")
    activation_checkpointing: str = setting("none", help="Recompute activations in backward: "
                                            f"{'; '.join(named(AC_HELP))}.")
    cp: int = setting(1, help="Context-parallel degree: each window split over this many workers "
                      "in 2 x cp chunks (worker i takes chunks i and 2cp-1-i), keys and values "
                      "all-gathered over them in every attention; they share the batch.")
