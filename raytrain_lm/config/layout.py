"""The parallel layout: one value, `Layout`, holding a run's choices of how its model and batch are
split over the workers (data, tensor, pipeline and expert parallelism, the data-parallel
strategy, the pipeline schedule, micro-batches, activation checkpointing, sequence parallelism),
every rule those choices obey and every fact derived from them. The checks, the planner,
`--layout auto` and parallel/ ask it instead of restating it. Pure Python.

The settings stay flat (`--tp`, `--strategy`, ...: config/parallelism.py's LayoutSettings, part of
TrainConfig); `Layout.of(cfg)` reads them and `Layout.apply(cfg)` writes them back.

Ranks: dp x cp x tp x pp = workers, tp innermost and pp outermost (parallel/mesh.py); expert
parallelism, where a family has experts, is carved out of the data-parallel ranks (as
torchtitan's ParallelDims: ep divides dp), so it adds no ranks of its own. Context parallelism
(cp) splits each window's sequence over cp ranks that read the same batch: they hold the same
parameters, so their gradients are reduced together with dp's (the "dp_cp" group, torchtitan's
dp_shard_cp), and FSDP shards over dp x cp. With experts too, an expert-parallel group is ep
ranks of one cp index (each routes its own chunks' tokens), and the experts' gradients are
reduced over edp x cp (the ranks that hold the same experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Optional

from raytrain_lm.config.parallelism import (
    AC_MODES,
    DEFAULT_VIRTUAL,
    PP_SCHEDULES,
    STRATEGIES,
    UNSHARDED,
    Strategy,
)
from raytrain_lm.errors import UserError
from raytrain_lm.models import family

if TYPE_CHECKING:
    from raytrain_lm.config.settings import TrainConfig
    from raytrain_lm.models.family import ModelConfig


def split_layers(n_layer: int, n_stages: int) -> list[range]:
    """Contiguous, as even as possible; any extra layers go to the middle stages, since the first
    and last stages also run the embeddings and the head."""
    if n_layer < n_stages:
        raise ValueError(f"{n_layer} layers cannot fill {n_stages} pipeline stages")
    sizes = [n_layer // n_stages] * n_stages
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), abs(s - n_stages / 2)))
    for s in order[: n_layer % n_stages]:
        sizes[s] += 1
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(st, st + n) for st, n in zip(starts, sizes)]


@dataclass(frozen=True)
class Coords:
    """A rank's place in the mesh."""
    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    strategy: str  # of the dp dimension: STRATEGIES
    ac: str  # activation checkpointing: AC_MODES
    sp: bool  # sequence parallelism (with tp)
    schedule: str  # PP_SCHEDULES; "-" without pp
    micro_batch: int  # b: sequences per micro-batch
    microbatches: int  # n: pipeline microbatches (pp > 1), else gradient-accumulation steps
    seq_len: int
    virtual: int = DEFAULT_VIRTUAL  # stages per worker of the interleaved schedule (the others run one)
    ep: int = 1  # expert-parallel ranks, out of dp (a family with experts)
    cp: int = 1  # context-parallel ranks: each window's sequence split over them
    # Of "tp", "pp", "fsdp": build that code even on a mesh dim of one rank, so one process runs
    # every layout's code (bench/gpu_check.py, tests); not a choice of the run (not compared).
    force: frozenset = field(default=frozenset(), compare=False)

    # ---------------------------------------------------------------- from and to the settings

    @classmethod
    def of(cls, cfg: TrainConfig, world: Optional[int] = None, force: frozenset = frozenset()) -> Layout:
        """The layout `cfg` trains with on `world` workers (default: --workers). Settings that
        make no layout at all are refused here, one line each; `problems` has the rest.
        `force`: Layout.force ("pp": a schedule and its microbatches even at --pp 1)."""
        world = cfg.workers if world is None else world
        if cfg.tp < 1 or cfg.pp < 1 or cfg.ep < 1 or cfg.cp < 1:
            raise UserError(f"--tp, --pp, --ep and --cp must be at least 1, got {cfg.tp}, {cfg.pp}, "
                            f"{cfg.ep} and {cfg.cp}")
        if world % cls.unit(cfg):
            raise UserError(f"--workers {world} must be a multiple of {cls.unit_text(cfg)} = "
                            f"{cls.unit(cfg)}: the data-parallel size is workers / "
                            f"({cls.unit_text(cfg).replace('--', '')})")
        if cfg.strategy not in STRATEGIES:
            raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {cfg.strategy!r}")
        if cfg.activation_checkpointing not in AC_MODES:
            raise UserError(f"--activation-checkpointing must be {', '.join(AC_MODES[:-1])} or "
                            f"{AC_MODES[-1]}, got {cfg.activation_checkpointing!r}")
        if cfg.pp_schedule not in PP_SCHEDULES:
            raise UserError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {cfg.pp_schedule!r}")
        if cfg.microbatches < 0:
            raise UserError(f"--microbatches must be >= 0 (0: twice the stages), got {cfg.microbatches}")
        if cfg.virtual_stages < 0 or cfg.virtual_stages == 1:
            raise UserError(f"--virtual-stages must be 0 ({DEFAULT_VIRTUAL}) or at least 2, got "
                            f"{cfg.virtual_stages}")
        if cfg.virtual_stages and cfg.pp_schedule != "interleaved-1f1b":
            raise UserError(f"--virtual-stages needs --pp-schedule interleaved-1f1b (--pp-schedule "
                            f"{cfg.pp_schedule} runs one stage per worker)")
        dp = world // cls.unit(cfg)
        common = dict(dp=dp, tp=cfg.tp, pp=cfg.pp, strategy=cfg.strategy,
                      ac=cfg.activation_checkpointing, sp=cfg.sequence_parallel, seq_len=cfg.seq_len,
                      virtual=cfg.virtual_stages or DEFAULT_VIRTUAL, ep=cfg.ep, cp=cfg.cp,
                      force=frozenset(force))
        if cfg.pp == 1 and "pp" not in force:
            return cls(schedule="-", micro_batch=cfg.batch_size, microbatches=cfg.grad_accum, **common)
        n = cfg.microbatches or 2 * cfg.pp * (common["virtual"] if cfg.pp_schedule == "interleaved-1f1b" else 1)
        if cfg.batch_size % n:
            raise UserError(f"--batch-size {cfg.batch_size} must be divisible by --microbatches "
                            f"{n}: each microbatch is batch-size / microbatches sequences")
        if cfg.grad_accum != 1:
            raise UserError("with --pp, the pipeline's --microbatches accumulate gradients: use them "
                            "instead of --grad-accum")
        return cls(schedule=cfg.pp_schedule, micro_batch=cfg.batch_size // n, microbatches=n, **common)

    @staticmethod
    def unit(cfg: TrainConfig) -> int:
        """The workers of one data-parallel rank: tp x pp x cp (--workers is a multiple of it)."""
        return cfg.tp * cfg.pp * cfg.cp

    @staticmethod
    def unit_text(cfg: TrainConfig) -> str:
        """Layout.unit in flags, for messages: "--tp x --pp", and "x --cp" where cp splits too."""
        return "--tp x --pp" + (" x --cp" if cfg.cp > 1 else "")

    def apply(self, cfg: TrainConfig) -> None:
        """Set cfg's layout settings to this layout (the data-parallel size follows from
        --workers; the global batch is workers x batch-size x grad-accum either way)."""
        cfg.tp, cfg.pp, cfg.ep, cfg.cp, cfg.strategy = self.tp, self.pp, self.ep, self.cp, self.strategy
        cfg.activation_checkpointing, cfg.sequence_parallel = self.ac, self.sp
        if self.pp > 1:
            cfg.pp_schedule, cfg.batch_size, cfg.microbatches, cfg.grad_accum = \
                self.schedule, self.sequences, self.microbatches, 1
            cfg.virtual_stages = self.v if self.schedule == "interleaved-1f1b" else 0
        else:
            cfg.batch_size, cfg.grad_accum, cfg.microbatches, cfg.virtual_stages = \
                self.micro_batch, self.microbatches, 0, 0

    def choices(self) -> dict:
        """The layout's choices by field name (`plan --json`), without `force`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.compare}

    def flags(self) -> str:
        """This layout as `train` flags (the data-parallel size follows from --workers)."""
        out = [f"--tp {self.tp}", f"--pp {self.pp}", f"--strategy {self.strategy}",
               f"--activation-checkpointing {self.ac}"]
        if self.ep > 1:
            out.append(f"--ep {self.ep}")
        if self.cp > 1:
            out.append(f"--cp {self.cp}")
        if self.sp:
            out.append("--sequence-parallel")
        if self.pp > 1:
            out += [f"--pp-schedule {self.schedule}", f"--batch-size {self.sequences}",
                    f"--microbatches {self.microbatches}"]
            if self.schedule == "interleaved-1f1b" and self.v != DEFAULT_VIRTUAL:
                out.append(f"--virtual-stages {self.v}")
        else:
            out += [f"--batch-size {self.micro_batch}", f"--grad-accum {self.microbatches}"]
        return " ".join(out)

    # ---------------------------------------------------------------- the rules

    def problems(self, m: ModelConfig, precision: str = "auto", compile: bool = False) -> list[str]:
        """What this layout cannot train for model `m` with `precision` (fp16: a gradient
        scaler) and `compile`, one line each, in the order a user should fix them; [] when it
        trains."""
        out = []
        heads = family(m).check_layout(m, self.tp, self.ep)
        if heads:
            out.append(heads)
        if m.block_size % self.tp:
            out.append(f"model.block_size ({m.block_size}) must be divisible by --tp {self.tp}")
        if m.vocab_size is not None and m.vocab_size % self.tp:
            out.append(f"model.vocab_size ({m.vocab_size}) must be divisible by --tp {self.tp}: the "
                       f"embedding is split over the vocabulary")
        if self.sp and self.tp == 1:
            out.append("--sequence-parallel needs --tp 2 or more")
        if self.sp and self.seq_len % self.tp:
            out.append(f"--seq-len {self.seq_len} must be divisible by --tp {self.tp} with "
                       f"--sequence-parallel")
        if self.ep > 1 and self.dp % self.ep:
            out.append(f"--ep {self.ep} must divide the data-parallel size {self.dp}: expert "
                       f"parallelism splits the data-parallel ranks")
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            out.append(f"--seq-len {self.seq_len} must be divisible by 2 x --cp = {2 * self.cp}: "
                       f"each window is split into {2 * self.cp} equal chunks")
        if compile and self.cp > 1:
            out.append("--compile works with --cp 1 for now")
        if compile and (self.tp > 1 or self.pp > 1):
            out.append("--compile works with --tp 1 --pp 1 (ddp or fsdp) for now")
        strategy = STRATEGIES[self.strategy]
        if strategy.plain_only and (self.tp > 1 or self.pp > 1):
            out.append(f"--strategy {self.strategy} works with --tp 1 --pp 1; use zero2 or fsdp "
                       f"with --tp/--pp")
        if not strategy.fp16 and precision == "fp16":
            out.append(f"--precision fp16 (a gradient scaler) is not supported with --strategy "
                       f"{self.strategy}; use bf16")
        if self.pp == 1:
            return out
        if m.n_layer < self.stages:
            out.append(f"model.n_layer ({m.n_layer}) is fewer than the {self.stages} pipeline stages "
                       f"of --pp {self.pp} --pp-schedule {self.schedule}")
        if self.microbatches < self.pp:
            out.append(f"--microbatches {self.microbatches} is fewer than the {self.pp} pipeline "
                       f"stages: the pipeline would never fill")
        if not self.rounds_fit:
            out.append(f"interleaved-1f1b needs --microbatches ({self.microbatches}) to be a "
                       f"multiple of --pp ({self.pp})")
        if precision == "fp16":
            out.append("--precision fp16 (a gradient scaler) is not supported with --pp; use bf16")
        return out

    @staticmethod
    def strategies(dp: int, tp: int, pp: int) -> list[str]:
        """The data-parallel strategies worth planning at this shape: every one `train` runs
        (zero1 only without tp and pp), less those that are another one here (zero2 when
        pipelined: a pipelined fsdp keeps its stages gathered already), ddp alone at dp 1
        (nothing to shard over)."""
        if dp == 1:
            return [UNSHARDED]
        return [s.name for s in STRATEGIES.values()
                if not (s.plain_only and (tp > 1 or pp > 1)) and not (s.pipelined_as and pp > 1)]

    def check_tp_within_node(self, workers_on_node: int) -> None:
        """On a GPU worker: its tp group (tp consecutive ranks; Ray gives a node's workers
        consecutive ranks) stays inside its node only if the node runs a multiple of tp workers.
        Tensor parallelism all-reduces activations in every layer: across nodes it crawls."""
        if self.tp > 1 and (workers_on_node < self.tp or workers_on_node % self.tp):
            raise UserError(f"--tp {self.tp} needs each tensor-parallel group's {self.tp} GPUs on one node, "
                    f"but a node runs {workers_on_node} of this run's workers; use nodes with a "
                    f"multiple of {self.tp} GPUs (cluster.yaml: gpu_8x) or a smaller --tp")

    def check_tp_fits_nodes(self, gpus_per_node: list[float]) -> None:
        """Before launch, where the cluster's nodes are known: some node holds a tp group (no GPU
        node yet passes: an autoscaler may add them, and the workers check again)."""
        most = int(max(gpus_per_node, default=0))
        if self.tp > 1 and most and most < self.tp:
            raise UserError(f"--tp {self.tp} needs {self.tp} GPUs on one node (tensor parallelism "
                    f"all-reduces activations in every layer) but the cluster's nodes have at most "
                    f"{most}; use nodes with {self.tp} or more GPUs (cluster.yaml: gpu_8x) or a "
                    f"smaller --tp")

    # ---------------------------------------------------------------- derived facts

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        """The ranks that hold the same parameters of a tp shard and pp stage and average their
        gradients: the data-parallel ranks and, within each, the context-parallel ones."""
        return self.dp * self.cp

    @property
    def v(self) -> int:
        """Pipeline stages per worker."""
        return self.virtual if self.schedule == "interleaved-1f1b" else 1

    @property
    def stages(self) -> int:
        """Pipeline stages in all."""
        return self.pp * self.v

    def layers(self, n_layer: int) -> list[range]:
        """Each pipeline stage's layers (parallel/pp.py builds them, the planner counts them)."""
        return split_layers(n_layer, self.stages)

    @property
    def sequences(self) -> int:
        """S: sequences per data-parallel rank per step."""
        return self.micro_batch * self.microbatches

    @property
    def rounds_fit(self) -> bool:
        """The microbatches fill the schedule's rounds: interleaved-1f1b sends them in rounds of
        pp, so it needs a multiple of pp; the others take any number."""
        return self.schedule != "interleaved-1f1b" or self.microbatches % self.pp == 0

    @property
    def tp_on(self) -> bool:
        """The model is built tensor-parallel (tp > 1, or forced)."""
        return self.tp > 1 or "tp" in self.force

    @property
    def pp_on(self) -> bool:
        """The model is built as pipeline stages (pp > 1, or forced)."""
        return self.pp > 1 or "pp" in self.force

    @property
    def fsdp_on(self) -> bool:
        """FSDP2 wraps the model over dp (sharded, or forced on one rank): it then owns the
        mixed precision (step.py)."""
        return self.sharded or ("fsdp" in self.force and self.by_fsdp)

    @property
    def replicated(self) -> bool:
        """A whole model on every rank, trained by DDP (Ray Train's prepare_model): no tp, no pp,
        and a strategy without FSDP2 (or one rank, with nothing to shard over); ZeRO-1 over two
        or more ranks is not: FSDP2 shards it at rest."""
        return not (self.tp_on or self.pp_on or self.fsdp_on) and self.ep == 1

    @property
    def by_fsdp(self) -> bool:
        """The strategy is built on FSDP2 (zero1, zero2, fsdp): it shards wherever dp > 1."""
        return STRATEGIES[self.strategy].fsdp

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the parameters and gradients (zero1, zero2, fsdp) over a dp dimension of 2 or
        more (fsdp.apply_dp); it then owns the mixed precision too (step.py)."""
        return self.by_fsdp and self.dp_cp > 1

    @property
    def param_shards(self) -> int:
        """Ranks each parameter and gradient is spread over at rest: dp where FSDP2 shards, else 1
        (a hybrid strategy would shard over part of dp and replicate over the rest)."""
        return self.dp_cp if self.sharded else 1

    @property
    def keeps_gathered(self) -> bool:
        """FSDP2 keeps each micro-step's gathered parameters until their backward (zero1, zero2)."""
        return STRATEGIES[self.strategy].keeps_gathered

    @property
    def gathers_once(self) -> bool:
        """FSDP2 keeps the gathered parameters through all of a step's micro-steps (zero1:
        ddp.no_sync), so a step gathers them once whatever its micro-steps."""
        return STRATEGIES[self.strategy].gathers_once

    @property
    def optimizer_shards(self) -> int:
        """Ranks AdamW's states are spread over: dp for every strategy but ddp."""
        return self.dp_cp if STRATEGIES[self.strategy].shards_optimizer else 1

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The device mesh's dims, outermost first (parallel/mesh.py builds it); a rank's place
        in it is `coords`. With expert parallelism dp is two dims, edp x ep (ep innermost: an
        expert-parallel group is ep dp ranks that differ in their ep index only), and "dp" their
        flattening; cp sits between dp and tp either way."""
        dp = {"edp": self.dp // self.ep, "ep": self.ep} if self.ep > 1 else {"dp": self.dp}
        cp = {"cp": self.cp} if self.cp > 1 else {}
        return {"pp": self.pp, **dp, **cp, "tp": self.tp}

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """Every dim a part of the model is placed on: the mesh's, "dp" where it is flattened, and
        with context parallelism "dp_cp" (dp x cp flattened: the parameters' group) and, with
        experts too, "edp_cp" (edp x cp: the ranks that hold the same experts)."""
        return tuple(self.mesh_shape) + (("dp",) if self.ep > 1 else ()) + \
            (("dp_cp",) if self.cp > 1 else ()) + (("edp_cp",) if self.cp > 1 and self.ep > 1 else ())

    def coords(self, rank: int) -> Coords:
        """Where `rank` sits in the mesh, row-major over mesh_shape (tp innermost), without
        building it (data sharding, seeds, logs)."""
        return Coords(pp=rank // (self.dp * self.cp * self.tp),
                      dp=(rank // (self.cp * self.tp)) % self.dp, tp=rank % self.tp,
                      cp=(rank // self.tp) % self.cp)

    @property
    def blocks(self) -> dict[str, int]:
        """Each dimension's groups as aligned blocks of consecutive ranks (parallel/mesh.py)."""
        return {"tp": self.tp, "cp": self.cp * self.tp, "dp": self.dp * self.cp * self.tp,
                "dp_cp": self.dp * self.cp * self.tp, "ep": self.ep * self.cp * self.tp,
                "edp_cp": self.dp * self.cp * self.tp, "pp": self.gpus}


__all__ = ["AC_MODES", "DEFAULT_VIRTUAL", "PP_SCHEDULES", "STRATEGIES", "UNSHARDED", "Coords", "Layout", "Strategy",
           "split_layers"]
