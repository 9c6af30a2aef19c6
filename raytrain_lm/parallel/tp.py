"""Tensor (and optional sequence) parallelism for any decoder of models/, with DTensor's
`parallelize_module` on the "tp" mesh dim. Works on the full model and on pipeline stages
(parallel/pp.py: Stage), which hold a subset of the same attributes. The roots (embeddings, head,
final norm) are the same in every family; a block's projections split as its family's tp plan
says (Family.tp_plan: colwise by output features, rowwise by input features).

Layouts (tp ranks r = 0..tp-1):
  colwise projections     ColwiseParallel: weight Shard(0), so rank r holds whole heads r*H/tp ..
                          (r+1)*H/tp-1 (the GPT's c_attn rows are head-interleaved, gpt.py; the
                          Llama's k/v heads r*KV/tp.., KV divisible by tp: Family.check_layout)
                          and a slice of the MLP's hidden units.
                          A colwise bias (Qwen2's q/k/v) is Shard(0) with its rows.
  rowwise projections     RowwiseParallel: weight Shard(1), bias Replicate; output all-reduced
                          (or reduce-scattered over the sequence with SP).
  head norms              (Qwen3's q/k norms, applied to each head of a colwise output)
                          `HeadParallel` below: weight Replicate, input this rank's heads as
                          Shard(2) of (B, T, heads, head size), so the weight's gradient is
                          summed over the ranks' heads (a Replicate input would keep each
                          rank's partial sum).
  wte                     RowwiseParallel on the embedding = Shard(0) of the (V, C) weight
                          (vocab-parallel lookup, masked, then all-reduce / reduce-scatter).
  lm_head                 ColwiseParallel = Shard(0) of the (V, C) weight; tied (the GPT, a
                          Llama-skeleton model with tie_embeddings), the
                          same DTensor as wte: one tensor, two users. Output logits stay
                          Shard(-1) (vocab) and cross_entropy runs under `loss_parallel()`: full
                          logits are never gathered.
  wpe                     (the GPT's positions) RowwiseParallel too: Shard(0) over positions; its
                          (T, C) output is all-reduced, or reduce-scattered over T with SP. The
                          Llama's rotary tables are plain buffers every rank holds whole.
  whole modules           (TPPlan.whole: a mixture of experts) plain parameters, the same on
                          every tp rank, computed on the whole sequence; with SP their input is
                          all-gathered and their output sliced back to this rank's part.
  norms                   SequenceParallel with SP (Replicate params, sequence-sharded
                          activations); without SP `ReplicateParallel` below makes their params
                          Replicate DTensors as well, so that every parameter is a DTensor
                          (optimizers, grad-norm and DCP then treat the model uniformly).
Sequence parallelism (as torchtitan): between blocks the residual stream is Shard(1) over the
sequence; PrepareModuleInput all-gathers it before attention / MLP; the row-parallel outputs are
reduce-scattered back to Shard(1).
Dropout: without SP activations are replicated across tp, so dropout masks must be identical on
all tp ranks of a group (seed per dp rank/pp stage, not per tp rank); with SP (and for attention
dropout on local heads) they should differ per tp rank. The tests use dropout 0.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from raytrain_lm.models import family


class ReplicateParallel(ParallelStyle):
    """Parameters become Replicate DTensors; plain inputs are taken as replicated and outputs
    handed back as plain tensors. For LayerNorms in TP without sequence parallelism."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_params, _inputs_as_replicate,
                                 _outputs_to_local)


class HeadParallel(ParallelStyle):
    """A norm applied to each head of a column-parallel output (Qwen3's q/k norms, on
    (B, T, heads, head size)): its weight a Replicate DTensor, its input this rank's heads as
    Shard(2) of all heads, so the weight's gradient is summed over the ranks' heads; the output
    handed back as this rank's plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_params, _inputs_as_head_shards,
                                 _outputs_to_local)


def _inputs_as_head_shards(module, inputs, mesh):
    return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False)
                 if not isinstance(t, DTensor) and hasattr(t, "shape") else t for t in inputs)


def _replicate_params(name, module, mesh):
    for pname, p in list(module.named_parameters(recurse=False)):
        # from_local, not distribute_tensor: works on meta and needs no broadcast (every rank
        # fills the same values at init).
        module.register_parameter(pname, nn.Parameter(
            DTensor.from_local(p, mesh, [Replicate()], run_check=False),
            requires_grad=p.requires_grad))


def _inputs_as_replicate(module, inputs, mesh):
    return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                 if not isinstance(t, DTensor) and hasattr(t, "shape") else t for t in inputs)


def _outputs_to_local(module, outputs, mesh):
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = True, local_logits: bool = False) -> nn.Module:
    """Parallelize a decoder or a Stage in place (ideally still on the meta device).

    loss_parallel: keep logits sharded over the vocabulary (the caller wraps forward+backward in
        `torch.distributed.tensor.parallel.loss_parallel()`); else all-gather them.
    local_logits: hand back the local logits shard as a plain tensor instead of a DTensor
        (pipeline stages: pipelining only moves plain tensors; the loss function re-wraps it).
    """
    sp = sequence_parallel
    seq = Shard(1)
    root_plan = {}
    if _has(module, "wte"):
        root_plan["wte"] = RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=seq if sp else Replicate())
    if _has(module, "wpe"):
        # wpe(pos) is (T, C): the sequence is dim 0 there.
        root_plan["wpe"] = RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=Shard(0) if sp else Replicate())
    if _has(module, "ln_f"):
        root_plan["ln_f"] = SequenceParallel() if sp else ReplicateParallel()
    if _has(module, "lm_head"):
        if loss_parallel:
            root_plan["lm_head"] = ColwiseParallel(input_layouts=seq if sp else Replicate(),
                                                   output_layouts=Shard(-1),
                                                   use_local_output=local_logits)
        else:
            root_plan["lm_head"] = ColwiseParallel(input_layouts=seq if sp else Replicate(),
                                                   output_layouts=Replicate())
    tied = _has(module, "wte") and _has(module, "lm_head") and \
        module.lm_head.weight is module.wte.weight
    parallelize_module(module, tp_mesh, root_plan)
    if tied:
        # Each style distributed the shared parameter on its own, giving two DTensors; both are
        # Shard(0) of the same (V, C) tensor, so point lm_head back at wte's.
        assert module.lm_head.weight.placements == module.wte.weight.placements
        module.lm_head.weight = module.wte.weight

    projections = family(module.cfg).tp_plan
    for block in _blocks(module):
        plan = {
            "ln_1": SequenceParallel() if sp else ReplicateParallel(),
            "ln_2": SequenceParallel() if sp else ReplicateParallel(),
            **{name: ColwiseParallel() for name in projections.colwise},
            **{name: RowwiseParallel(output_layouts=seq) if sp else RowwiseParallel()
               for name in projections.rowwise},
            **{name: HeadParallel() for name in projections.head_norms if _has_path(block, name)},
        }
        if sp:  # all-gather the sequence before attention and the MLP
            plan["attn"] = PrepareModuleInput(input_layouts=(seq, None),
                                              desired_input_layouts=(Replicate(), None))
            plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            for name in projections.whole:  # the whole sequence in, this rank's part out
                plan[name] = PrepareModuleInputOutput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
    return module


def _has(module: nn.Module, name: str) -> bool:
    return getattr(module, name, None) is not None


def _has_path(module: nn.Module, path: str) -> bool:
    """Whether `module` has the submodule `path` ("attn.q_norm")."""
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


def _blocks(module: nn.Module):
    h = module.h
    return h.values() if isinstance(h, nn.ModuleDict) else list(h)
