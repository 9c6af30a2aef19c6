"""Builds the model as this rank holds it, from outside the models (which import nothing from
torch.distributed), from the run's Layout (config/layout.py) and its family's tensor-parallel
plan (models/); worker/step.py runs what it builds.

`parallelize(cfg, device)` returns `Built`: the parts, the modules to call, the pipeline schedule
and what running it needs. Replicated layouts (no tp, no pp, ddp) wrap a whole model in
DDP through Ray Train's `prepare_model`; the others are built on the meta device, split into
stages, tensor-parallelized, sharded or replicated over dp, and only then materialised, each rank
filling its own shards with the single-process build's values (docs/parallelism.md).

    mesh.py   the device mesh of the layout's mesh_shape
    ac.py     activation checkpointing (full, selective, op)
    ddp.py    DDP through ray.train.torch.prepare_model; no_sync for accumulation
    ep.py     expert parallelism: experts sharded by expert, tokens by all-to-all; MoE metrics
    fsdp.py   FSDP2 or FSDP2's replicate on the dp dim; what a rank holds
    tp.py     tensor (and sequence) parallelism with DTensor; loss without gathering logits
    pp.py     pipeline stages, schedules, a tied embedding across first and last stage
    cp.py     context parallelism: windows split over cp ranks, K/V all-gathered; document masks
    ring.py   ring attention (K/V passed around the cp ranks): measured against cp.py's gather
    init.py   meta -> local shards -> initial values
    grad.py   gradients in their parameters' layouts; the global gradient norm
    traffic.py bytes per mesh dim per step; the pipeline's bubble
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from raytrain_lm.config.layout import Coords, Layout
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.models import attention, build_model, family
from raytrain_lm.models.decoder import fit_positions_
from raytrain_lm.parallel import ddp, ep, fsdp
from raytrain_lm.parallel.ac import apply_activation_checkpointing
from raytrain_lm.parallel.mesh import build_mesh, dim_mesh, is_distributed


def parallelize(cfg: TrainConfig, device: torch.device, dtype: Optional[torch.dtype] = None,
                force: frozenset = frozenset(), ddp_wrap=None, init: bool = True,
                separator: Optional[int] = None) -> "Built":
    """The model of `cfg` as this rank holds it (see Built)."""
    return Built(cfg, device, dtype, force, ddp_wrap, init, separator)


class Built:
    """The model as this rank holds it: its parts (one, or its pipeline stages), the modules to
    call, and what a step on this layout needs to run them: the mesh, the pipeline schedule and
    its loss, the tied-embedding and pp groups, `norm_exclude`, `reports_loss`. Nothing here
    steps: worker/step.py owns the optimizers, the step and validation."""

    def __init__(self, cfg: TrainConfig, device: torch.device,
                 dtype: Optional[torch.dtype] = None, force: frozenset = frozenset(),
                 ddp_wrap=None, init: bool = True, separator: Optional[int] = None):
        """`dtype`: mixed precision's (None: fp32); FSDP takes it as its MixedPrecisionPolicy
        where it shards over dp (`mixed_by_fsdp`: then nothing else may cast, see step.py).
        `force` (Layout.force: "tp", "pp", "fsdp"): apply those even on a mesh dim of one rank,
        so one process runs every layout's code (bench/gpu_check.py); `ddp_wrap`: DDP's wrapper in
        place of Ray Train's prepare_model (parallel/ddp.py). `init` False: a model built
        sharded is left with its memory as allocated, for a caller that fills every parameter
        next (a checkpoint, --init-from), which then costs no initial values. `separator`: the
        token that opens a document, with --doc-mask (attention stays inside documents)."""
        self.cfg, self.device, self.dtype, self.init = cfg, device, dtype, init
        world = dist.get_world_size() if is_distributed() else 1
        rank = dist.get_rank() if is_distributed() else 0
        self.layout = lay = Layout.of(cfg, world, force=force)
        self.coords: Coords = lay.coords(rank)
        self.dp = lay.dp
        self.tp_on, self.pp_on, self.replicated = lay.tp_on, lay.pp_on, lay.replicated
        # context parallelism needs its group even where Ray's DDP replicates the model
        self.mesh = None if self.replicated and lay.cp == 1 else build_mesh(device, lay)
        # FSDP's MixedPrecisionPolicy, where it shards, is the run's mixed precision (step.py)
        self.mixed_by_fsdp = dtype is not None and lay.fsdp_on
        self.schedule = self.loss_fn = self.tied_group = self.pp_group = None
        self.has_first = self.has_last = True
        self.norm_exclude: set[int] = set()
        if self.replicated:
            with torch.device(device):  # built and initialised on the device (model.init_device)
                model = build_model(cfg.model, seed=cfg.seed)
            fit_positions_(model, cfg.seq_len)  # before compile: the tables the run reads
            apply_activation_checkpointing(model, cfg.activation_checkpointing)
            self.parts, self.modules = [model], [ddp.replicate(model, cfg.compile, ddp_wrap)]
        else:
            self.parts = self._build_sharded()
            self.modules = self.parts
        if self.pp_on:
            self._build_pipeline()
        # The ranks whose loss is their dp group's (tp ranks hold copies; with pp, the last stage;
        # with cp, the first cp rank, after summing its group's parts: step.py).
        self.sums_loss = self.coords.tp == 0 and self.coords.pp == lay.pp - 1  # a part of it
        self.reports_loss = self.sums_loss and self.coords.cp == 0
        self.cp_group = self.mesh["cp"].get_group() if lay.cp > 1 else None
        self.context = None  # how a batch's windows become this rank's tokens and span
        if lay.cp > 1 or (cfg.doc_mask and separator is not None):
            from raytrain_lm.parallel.cp import ContextParallel

            self.context = ContextParallel(lay.cp, self.coords.cp, self.cp_group,
                                           separator if cfg.doc_mask else None)
        if lay.cp > 1:  # a mixture of experts' balance loss counts each window's every token
            for part in self.parts:
                for _, layer in ep.moe_layers(part):
                    layer.window_sum = self.context.window_sum

    # ---------------------------------------------------------------- building

    def _build_sharded(self) -> list[nn.Module]:
        from raytrain_lm.parallel import pp, tp
        from raytrain_lm.parallel.init import materialize_

        cfg = self.cfg
        if self.pp_on:
            self.stages = pp.build_stage_modules(cfg.model, self.layout, self.coords.pp)
        else:
            with torch.device("meta"):
                self.stages = [(0, build_model(cfg.model))]
        for _, part in self.stages:
            apply_activation_checkpointing(part, cfg.activation_checkpointing)
            if self.tp_on:
                tp.apply_tp(part, self.mesh["tp"], sequence_parallel=cfg.sequence_parallel,
                            local_logits=self.pp_on)
            experts = self.layout.ep > 1
            if experts:
                ep.apply_ep(part, self.mesh["ep"], fsdp.blocks(part))
            fsdp.apply_dp(part, dim_mesh(self.mesh, "dp_cp" if self.layout.cp > 1 else "dp"),
                          self.layout, self.dtype, compile=cfg.compile,
                          edp_mesh=self._experts_mesh() if experts else None)
            materialize_(part, cfg.model, cfg.seed, self.device, init=self.init)
            fit_positions_(part, cfg.seq_len)  # before the first (compiled) forward
        return [part for _, part in self.stages]

    def _experts_mesh(self):
        """The ranks that hold the same experts and average their gradients: edp, and with
        context parallelism the cp ranks within each (parallel/mesh.py)."""
        return dim_mesh(self.mesh, "edp_cp") if self.layout.cp > 1 else self.mesh["edp"]

    def _build_pipeline(self) -> None:
        from raytrain_lm.parallel import pp

        cfg = self.cfg
        tp_mesh = self.mesh["tp"] if self.tp_on else None
        self.loss_fn = pp.PipelineLoss(tp_mesh)
        self.schedule = pp.build_schedule(self.layout, self.stages, self.mesh["pp"], self.loss_fn,
                                          self.device)
        self.has_first = any(m.is_first for m in self.parts)
        self.has_last = any(m.is_last for m in self.parts)
        self.pp_group = self.mesh["pp"].get_group()
        # a tied embedding lives on the first and the last stage; an untied head is its own
        self.tied_group = pp.tied_group(self.mesh) if family(cfg.model).tied(cfg.model) else None
        self.norm_exclude = pp.duplicate_tied_params(self.parts)

    # ---------------------------------------------------------------- running it

    def params(self) -> list[nn.Parameter]:
        return list({id(p): p for part in self.parts for p in part.parameters()}.values())

    def loss_ctx(self):
        """Under tensor parallelism the logits stay sharded over the vocabulary and the loss is
        computed on the shards (forward and backward inside loss_parallel)."""
        if self.tp_on:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def shard(self, x: torch.Tensor, y: torch.Tensor):
        """(this rank's inputs, its targets, the context its forward and backward run in): the
        whole windows and no mask without context parallelism or document masking."""
        if self.context is None:
            return x, y, contextlib.nullcontext()
        x, y, span = self.context.shard(x, y)
        return x, y, attention.using(span)

    def stage_kwargs(self, x: torch.Tensor) -> dict:
        """What a pipeline schedule's step hands every stage beside the first stage's inputs `x`:
        each row's index in the batch where attention differs by row (document masking), for
        the stages to take their microbatch's part of the span (parallel/pp.py)."""
        if self.context is None or self.context.separator is None:
            return {}
        from raytrain_lm.parallel.pp import microbatch_kwargs

        return microbatch_kwargs(x)

    def train(self, mode: bool = True) -> None:
        for module in self.modules:
            module.train(mode)
