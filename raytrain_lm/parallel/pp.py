"""Pipeline parallelism with torch.distributed.pipelining, stages built by hand (no tracer).

* Split by layers (Layout.layers): stage s holds blocks layers[s]; the first stage also what the
  model's `embed` uses (Decoder.EMBED: the GPT's wte/wpe/drop, the Llama's wte), the last ln_f and
  lm_head. A stage module keeps the full model's FQNs (h is a ModuleDict keyed by the original
  layer index: "h.5.attn.c_attn.weight" in the stage is the same key as in the model), so DCP
  checkpoints and the layout-independent init work across layouts unchanged.
* Tied embeddings (Megatron's "embedding group": a decoder whose head is tied, the GPT): the last
  stage holds its own copy of `wte` (registered as `wte`, with lm_head.weight tied to it, exactly
  as in the model), initialised to the same
  values by construction. After each backward the gradients of the two copies are summed across
  the first and last stage (`sync_tied_grads`), so both copies take identical optimizer steps and
  the result equals the tied single-process model. The global grad norm counts the copy once.
* Loss scaling: the schedule calls loss_fn per microbatch (mean over its tokens) and, with
  scale_grads=True (default), divides the accumulated grads by n_microbatches after the last
  backward. Equal microbatches => grads of the whole-batch mean loss. Losses come back per
  microbatch on the last stage; their mean is the batch loss.
* Stage placement: "loop" style, stage s on pp rank s % pp (Interleaved1F1B with v stages/rank).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Shard

from raytrain_lm.config.layout import Layout
from raytrain_lm.models import attention, build_model
from raytrain_lm.models.decoder import Decoder, attach_aux_loss, take_aux_losses
from raytrain_lm.parallel.mesh import world_timeout

PIPELINE_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


class Stage(nn.Module):
    """The part of a decoder (any family's) one pipeline stage runs. It takes the
    model's own submodules (build it on the meta device first: taking them is free) and runs the
    model class's embed / blocks / head, so the math is the model file's. A Llama's blocks bring
    the rotary tables they share (models/llama/llama.py), so every stage has them."""

    def __init__(self, model: Decoder, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.cfg, self.arch = model.cfg, type(model)
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            for name in model.EMBED:
                setattr(self, name, getattr(model, name))
        if is_last and model.tied:
            self.wte = model.wte  # the last stage's copy serves lm_head (tied)
        self.h = nn.ModuleDict({str(i): model.h[i] for i in layers})
        if is_last:
            for name in model.HEAD:
                setattr(self, name, getattr(model, name))

    def forward(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`rows`: this microbatch's rows of the step's batch, where attention differs by row
        (document masking: the installed span is the whole batch's, `microbatch_kwargs`)."""
        span = attention.current()
        if rows is None or span is None:
            return self._forward(x)
        with attention.using(span.of_rows(rows)):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.arch.embed(self, x)  # token ids -> embeddings
        for block in self.h.values():
            x, _ = block(x)
        if self.training:  # a mixture of experts' load balancing, trained with this stage's output
            x = attach_aux_loss(x, take_aux_losses(self.h))
        if self.is_last:
            x = self.arch.head(self, x)  # logits (the local vocab shard under TP)
        return x


def microbatch_kwargs(x: torch.Tensor) -> dict:
    """What a schedule's step passes every stage beside the first stage's inputs when attention
    differs by row (document masking): each row's index in the batch, which the schedule splits
    into microbatches as it splits the inputs, so each stage attends by its microbatch's rows of
    the span (every pp rank reads the same batch: the span is whole on each)."""
    return {"rows": torch.arange(x.size(0), device=x.device)}


def stage_ids(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    return [pp_rank + v * pp_size for v in range(stages_per_rank)]


def build_stage_modules(m, layout: Layout, pp_rank: int) -> list[tuple[int, Stage]]:
    """(stage index, stage module) for this rank, on the meta device."""
    splits = layout.layers(m.n_layer)
    with torch.device("meta"):
        full = build_model(m)
    out = []
    for s in stage_ids(pp_rank, layout.pp, layout.v):
        # This rank's stages take disjoint modules out of its meta model: wte goes to both the
        # first and the last stage (tied), but with pp > 1 those are never on the same rank.
        out.append((s, Stage(full, splits[s], s == 0, s == layout.stages - 1)))
    return out


class PipelineLoss:
    """The schedule's loss function, per microbatch: the mean token loss (training: the schedule
    then scales the gradients by 1/microbatches), or within `summing()` the sum over the
    microbatch's targets (validation, whose padding windows carry ignored targets). Under TP the
    last stage emits its local vocabulary shard of the logits as a plain tensor (pipelining moves
    plain tensors); it is re-wrapped as a Shard(-1) DTensor so the cross-entropy runs
    vocab-parallel (the caller holds loss_parallel())."""

    def __init__(self, tp_mesh: DeviceMesh | None):
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.reduction = "mean"

    @contextlib.contextmanager
    def summing(self):
        self.reduction = "sum"
        try:
            yield
        finally:
            self.reduction = "mean"

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is not None:
            logits = DTensor.from_local(logits, self.tp_mesh, [Shard(-1)], run_check=False)
        # at least float32, as the decoder's own loss (a float64 model stays float64)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1),
                               reduction=self.reduction)
        return loss.to_local() if isinstance(loss, DTensor) else loss  # replicated over tp


def build_schedule(layout: Layout, stages: list[tuple[int, nn.Module]], pp_mesh: DeviceMesh,
                   loss_fn, device="cpu"):
    cls = PIPELINE_SCHEDULES[layout.schedule]
    group = pp_mesh.get_group()
    pstages = [PipelineStage(m, s, layout.stages, torch.device(device), group=group)
               for s, m in stages]
    for stage in pstages:
        _stats_in_chunks_only(stage)
    if cls is ScheduleInterleaved1F1B:
        return cls(pstages, layout.microbatches, loss_fn=loss_fn, scale_grads=True)
    if len(pstages) != 1:
        raise ValueError(f"{layout.schedule} runs one stage per rank")
    return cls(pstages[0], layout.microbatches, loss_fn=loss_fn, scale_grads=True)


def _stats_in_chunks_only(stage: PipelineStage) -> None:
    """A mixture of experts' statistics count the schedule's microbatches only: on its first step
    a stage also runs its module once on uninitialised inputs of the right shapes, to learn its
    outputs' (torch.distributed.pipelining's metadata inference)."""
    layers = [m for m in stage.submod.modules() if hasattr(m, "keeps_stats")]
    if not layers:
        return
    chunk = stage.forward_one_chunk

    def counted(*args, **kwargs):
        for layer in layers:
            layer.keeps_stats = True
        try:
            return chunk(*args, **kwargs)
        finally:
            for layer in layers:
                layer.keeps_stats = False

    for layer in layers:
        layer.keeps_stats = False
    stage.forward_one_chunk = counted


def tied_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group joining, for this rank's (dp, tp) coordinates, the pp ranks holding the
    first and the last stage (pp ranks 0 and pp-1 in loop placement). Every rank must call this
    (new_group is collective)."""
    pp = mesh["pp"].size()
    if pp == 1:
        return None
    if pp == 2:
        return mesh["pp"].get_group()
    mine = None
    for ranks in tied_pairs(mesh.mesh):
        g = dist.new_group(ranks, timeout=world_timeout())
        if dist.get_rank() in ranks:
            mine = g
    return mine


def tied_pairs(grid: torch.Tensor) -> list[list[int]]:
    """For a mesh's global ranks (pp first, then dp, tp; with expert parallelism edp, ep, tp),
    each pair [first stage's rank, last stage's rank] with the same coordinates on the other
    dims, in the mesh's order."""
    ends = grid.reshape(grid.shape[0], -1)[[0, -1]]  # (2, every other coordinate)
    return ends.t().tolist()


def tied_params(stage_modules: list[nn.Module]) -> list[nn.Parameter]:
    return [m.wte.weight for m in stage_modules if getattr(m, "wte", None) is not None]


@torch.no_grad()
def sync_tied_grads(stage_modules: list[nn.Module], group) -> None:
    """Sum the wte gradient over the first and last stage: each copy then holds the tied
    model's gradient (lookup part + output-projection part)."""
    if group is None:
        return
    for p in tied_params(stage_modules):
        g = p.grad
        if g is None:
            g = p.grad = torch.zeros_like(p)
        dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=group)


def duplicate_tied_params(stage_modules: list[nn.Module]) -> set[int]:
    """ids of parameters to leave out of the global grad norm: the last stage's wte copy (the
    first stage's copy counts for both)."""
    return {id(m.wte.weight) for m in stage_modules
            if getattr(m, "is_last", False) and not m.is_first and getattr(m, "wte", None) is not None}
